"""Same as ``python -m quack_kernels.bench``; works from a checkout without installing."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from quack_kernels.bench import main  # noqa: E402

sys.exit(main())
