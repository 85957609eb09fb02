"""Suite-wide settings and plugins.

Torch runs single-threaded in the test process: the models here are tiny, and on a
2-core CI machine intra-op threads only contend with the servers the tests start.
The fixtures more than one suite uses (``live``, ``cli_server``) are in tests/fixtures.py.
"""

import torch

pytest_plugins = ["tests.fixtures"]

torch.set_num_threads(1)
