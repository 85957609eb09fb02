"""Suite-wide settings.

Torch runs single-threaded in the test process: the models here are tiny, and on a
2-core CI machine intra-op threads only contend with the servers the tests start.
"""

import torch

torch.set_num_threads(1)
