"""Suite-wide setup.

One intra-op thread: ``spawn_ranks`` forks, and a child forked after the parent ran an
OpenMP-parallel kernel (e.g. a layer_norm backward) hangs in its first parallel kernel.
With one thread the parent never starts the OpenMP pool. (Also kinder to 2 shared cores.)
"""

import torch

torch.set_num_threads(1)
