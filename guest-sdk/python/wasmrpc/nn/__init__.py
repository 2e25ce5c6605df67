"""`torch.nn` for plugins: `Module`, `Parameter`, layers, containers,
losses, `nn.functional` and `nn.init`, computed in the worker by aten ops
(so autograd, budgets and the op policy apply as to any op).

`nn.Module` subclasses are written as in PyTorch; parameter names and
default initialisations are torch's, so `load_state_dict` takes a torch
model's `state_dict` (tensors sent over RPC or loaded with
`wasmrpc.load`)."""

from . import _transfer, functional, init
from .modules import (
    AdaptiveAvgPool2d,
    AvgPool2d,
    BatchNorm1d,
    BatchNorm2d,
    BCELoss,
    BCEWithLogitsLoss,
    Conv1d,
    Conv2d,
    CrossEntropyLoss,
    Dropout,
    Dropout2d,
    ELU,
    Embedding,
    Flatten,
    GELU,
    Hardtanh,
    Identity,
    L1Loss,
    LayerNorm,
    LeakyReLU,
    Linear,
    LogSigmoid,
    LogSoftmax,
    MaxPool2d,
    Mish,
    Module,
    ModuleDict,
    ModuleList,
    MSELoss,
    NLLLoss,
    Parameter,
    ParameterList,
    ReLU,
    ReLU6,
    SELU,
    Sequential,
    Sigmoid,
    SiLU,
    SmoothL1Loss,
    Softmax,
    Softmin,
    Softplus,
    Tanh,
    Unflatten,
)
from .rnn import GRU, LSTM, RNN, GRUCell, LSTMCell, RNNBase, RNNCell

__all__ = [n for n in dir() if not n.startswith("_")]
