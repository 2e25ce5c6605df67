"""wasmrpc for a Python program: `torch.distributed.rpc`'s API, on the
wasmrpc host.

```python
import torch
from wasmrpc import rpc

rpc.init_rpc("driver", rank=0, world_size=3)   # MASTER_ADDR/PORT, as torch's
y = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
z = rpc.rpc_sync("worker2", "my_plugin::step", args=(y,))   # a wasm plugin
rpc.shutdown()
```

A process that calls `rpc.init_rpc` joins a group of `wasmrpc worker`s
(and of other Python processes) through the same rendezvous and
credentials. Functions are called by their registered names: a builtin op
(`torch.add`, mapped to `aten::add` as PyTorch maps it, or the string
`"aten::add"`) or a plugin's function (`"plugin::fn"`). Nothing is pickled:
a Python function of the program cannot be sent, and this process serves
only the builtin ops its op policy allows and the plugins its options load.

Tensors are torch's own: they cross into the host without a copy, and the
distributed autograd functions the host records join the autograd graph
Python built.

`wasmrpc.plugin(path)` names a plugin's functions and classes, read from
its file: `rpc.rpc_sync("worker1", mine.step, args=(t,))`, and
`mine.Model.forward` passed as an argument travels as a reference.

Modules: `wasmrpc.rpc` (`torch.distributed.rpc`),
`wasmrpc.distributed.autograd` (`torch.distributed.autograd`),
`wasmrpc.distributed.optim` (`torch.distributed.optim`).
"""

# torch first: the extension module links the libtorch it loads.
import torch  # noqa: F401

from . import _native  # noqa: F401
from . import rpc  # noqa: F401
from . import distributed  # noqa: F401
from .plugins import FunctionRef, plugin

__all__ = ["FunctionRef", "distributed", "plugin", "rpc"]
