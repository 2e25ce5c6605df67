"""`nn.RNN`, `nn.LSTM`, `nn.GRU` and their cells, with torch's parameter
names (`weight_ih_l0`, `bias_hh_l1_reverse`, ...), gate order (LSTM: i, f,
g, o; GRU: r, z, n), initialisation (U(±1/sqrt(hidden_size))) and return
values.

The worker's op policy serves no fused recurrent op (`aten::lstm`,
`aten::gru` and their cells are outside its families), so each time step
is the cell's math in aten ops: the input projection of all steps at once
(one `linear`), then per step one `linear` of the hidden state and the
gates. Autograd records it like any other ops."""

import math

from ..tensor import op
from . import functional as F
from . import init
from .modules import Module, Parameter


def _zeros(*size):
    return op("aten::zeros", list(size))


def _lstm_cell(gi, h, c, w_hh, b_hh):
    """One LSTM step; `gi` is the input's projection `x @ w_ih.T + b_ih`."""
    gates = op("aten::add", gi, F.linear(h, w_hh, b_hh))
    i, f, g, o = op("aten::chunk", gates, 4, 1)
    c = op("aten::add", op("aten::mul", op("aten::sigmoid", f), c),
           op("aten::mul", op("aten::sigmoid", i), op("aten::tanh", g)))
    h = op("aten::mul", op("aten::sigmoid", o), op("aten::tanh", c))
    return h, c


def _gru_cell(gi, h, w_hh, b_hh):
    """One GRU step (torch's formula: `n = tanh(i_n + r * (W_hn h + b_hn))`)."""
    gh = F.linear(h, w_hh, b_hh)
    i_r, i_z, i_n = op("aten::chunk", gi, 3, 1)
    h_r, h_z, h_n = op("aten::chunk", gh, 3, 1)
    r = op("aten::sigmoid", op("aten::add", i_r, h_r))
    z = op("aten::sigmoid", op("aten::add", i_z, h_z))
    n = op("aten::tanh", op("aten::add", i_n, op("aten::mul", r, h_n)))
    # h' = (1 - z) * n + z * h, written as torch's kernel does: n + z * (h - n).
    return op("aten::add", n, op("aten::mul", z, op("aten::sub", h, n)))


def _rnn_cell(gi, h, w_hh, b_hh, nonlinearity):
    pre = op("aten::add", gi, F.linear(h, w_hh, b_hh))
    return op("aten::tanh" if nonlinearity == "tanh" else "aten::relu", pre)


class RNNBase(Module):
    """The layers, directions and time loop shared by RNN, LSTM and GRU."""

    _GATES = 1
    _MODE = "RNN_TANH"

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False, dropout=0.0,
                 bidirectional=False, proj_size=0, device=None, dtype=None):
        super().__init__()
        if proj_size:
            raise NotImplementedError("LSTM(proj_size=...) is not supported")
        if not 0 <= dropout <= 1:
            raise ValueError("dropout should be a number in range [0, 1]")
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.dropout = bias, batch_first, float(dropout)
        self.bidirectional = bidirectional
        self.proj_size = 0
        dirs = 2 if bidirectional else 1
        gh = self._GATES * hidden_size
        for layer in range(num_layers):
            for d in range(dirs):
                sfx = f"_l{layer}" + ("_reverse" if d else "")
                layer_in = input_size if layer == 0 else hidden_size * dirs
                self.register_parameter("weight_ih" + sfx, Parameter(_zeros(gh, layer_in)))
                self.register_parameter("weight_hh" + sfx, Parameter(_zeros(gh, hidden_size)))
                if bias:
                    self.register_parameter("bias_ih" + sfx, Parameter(_zeros(gh)))
                    self.register_parameter("bias_hh" + sfx, Parameter(_zeros(gh)))
        self.reset_parameters()

    def reset_parameters(self):
        """U(-1/sqrt(hidden_size), 1/sqrt(hidden_size)) for every weight, as torch."""
        stdv = 1.0 / math.sqrt(self.hidden_size) if self.hidden_size > 0 else 0
        for w in self.parameters():
            init.uniform_(w, -stdv, stdv)

    def _weights(self, layer, d):
        sfx = f"_l{layer}" + ("_reverse" if d else "")
        p = self._parameters
        return p["weight_ih" + sfx], p["weight_hh" + sfx], p.get("bias_ih" + sfx), p.get("bias_hh" + sfx)

    def _initial(self, hx, batch, batched):
        """The initial states, `(layers * dirs, batch, hidden)` each."""
        n = self.num_layers * (2 if self.bidirectional else 1)
        count = 2 if self._MODE == "LSTM" else 1
        if hx is None:
            return [_zeros(n, batch, self.hidden_size) for _ in range(count)]
        states = list(hx) if self._MODE == "LSTM" else [hx]
        if len(states) != count:
            raise ValueError(f"{type(self).__name__} expects {count} initial state tensor(s)")
        if not batched:
            states = [op("aten::unsqueeze", s, 1) for s in states]
        return states

    def _step(self, gi, state, w_hh, b_hh):
        if self._MODE == "LSTM":
            return _lstm_cell(gi, state[0], state[1], w_hh, b_hh)
        if self._MODE == "GRU":
            return (_gru_cell(gi, state[0], w_hh, b_hh),)
        return (_rnn_cell(gi, state[0], w_hh, b_hh, "tanh" if self._MODE == "RNN_TANH" else "relu"),)

    def forward(self, input, hx=None):  # noqa: A002 (torch's name)
        """`(output, h_n)`, for LSTM `(output, (h_n, c_n))`, as torch: output
        `(seq, batch, dirs * hidden)` (batch first with `batch_first`)."""
        if not hasattr(input, "dim"):
            raise NotImplementedError("packed sequences are not supported: pass a padded tensor")
        batched = input.dim() == 3
        if not batched:
            input = op("aten::unsqueeze", input, 0 if self.batch_first else 1)
        x = op("aten::transpose", input, 0, 1) if self.batch_first else input
        steps, batch = x.shape[0], x.shape[1]
        init_states = self._initial(hx, batch, batched)
        dirs = 2 if self.bidirectional else 1
        finals = [[] for _ in init_states]
        layer_input = x
        for layer in range(self.num_layers):
            outputs = []
            for d in range(dirs):
                w_ih, w_hh, b_ih, b_hh = self._weights(layer, d)
                idx = layer * dirs + d
                state = tuple(op("aten::select", s, 0, idx) for s in init_states)
                # The input projection of every step at once.
                gi = F.linear(layer_input, w_ih, b_ih)
                seq = [None] * steps
                order = range(steps - 1, -1, -1) if d else range(steps)
                for t in order:
                    state = self._step(op("aten::select", gi, 0, t), state, w_hh, b_hh)
                    seq[t] = state[0]
                outputs.append(op("aten::stack", seq, 0))
                for k, s in enumerate(state):
                    finals[k].append(s)
            layer_input = outputs[0] if dirs == 1 else op("aten::cat", outputs, 2)
            if self.dropout and self.training and layer < self.num_layers - 1:
                layer_input = F.dropout(layer_input, self.dropout, True)
        output = op("aten::transpose", layer_input, 0, 1) if self.batch_first else layer_input
        states = [op("aten::stack", f, 0) for f in finals]
        if not batched:
            output = op("aten::squeeze", output, 0 if self.batch_first else 1)
            states = [op("aten::squeeze", s, 1) for s in states]
        if self._MODE == "LSTM":
            return output, (states[0], states[1])
        return output, states[0]

    def extra_repr(self):
        s = f"{self.input_size}, {self.hidden_size}"
        if self.num_layers != 1:
            s += f", num_layers={self.num_layers}"
        if self.batch_first:
            s += ", batch_first=True"
        if self.bidirectional:
            s += ", bidirectional=True"
        return s


class RNN(RNNBase):
    """Elman RNN: `h' = tanh(x W_ih.T + b_ih + h W_hh.T + b_hh)` (or relu)."""

    def __init__(self, *args, nonlinearity="tanh", **kwargs):
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"Unknown nonlinearity '{nonlinearity}'")
        object.__setattr__(self, "_MODE", "RNN_TANH" if nonlinearity == "tanh" else "RNN_RELU")
        super().__init__(*args, **kwargs)
        object.__setattr__(self, "nonlinearity", nonlinearity)


class LSTM(RNNBase):
    """LSTM; `forward` returns `(output, (h_n, c_n))`."""

    _GATES = 4
    _MODE = "LSTM"


class GRU(RNNBase):
    """GRU; `forward` returns `(output, h_n)`."""

    _GATES = 3
    _MODE = "GRU"


class _CellBase(Module):
    _GATES = 1

    def __init__(self, input_size, hidden_size, bias=True, device=None, dtype=None):
        super().__init__()
        self.input_size, self.hidden_size, self.bias = input_size, hidden_size, bias
        gh = self._GATES * hidden_size
        self.weight_ih = Parameter(_zeros(gh, input_size))
        self.weight_hh = Parameter(_zeros(gh, hidden_size))
        if bias:
            self.bias_ih = Parameter(_zeros(gh))
            self.bias_hh = Parameter(_zeros(gh))
        else:
            self.register_parameter("bias_ih", None)
            self.register_parameter("bias_hh", None)
        RNNBase.reset_parameters(self)

    def _prepare(self, input, hx):  # noqa: A002
        batched = input.dim() == 2
        if not batched:
            input = op("aten::unsqueeze", input, 0)
        if hx is None:
            batch = input.shape[0]
            hx = _zeros(batch, self.hidden_size)
        elif not batched:
            hx = op("aten::unsqueeze", hx, 0)
        return input, hx, batched


class LSTMCell(_CellBase):
    """One LSTM step: `(h', c') = cell(x, (h, c))`."""

    _GATES = 4

    def forward(self, input, hx=None):  # noqa: A002
        h, c = (None, None) if hx is None else hx
        x, h, batched = self._prepare(input, h)
        c = h if hx is None else (c if batched else op("aten::unsqueeze", c, 0))
        h2, c2 = _lstm_cell(F.linear(x, self.weight_ih, self.bias_ih), h, c, self.weight_hh, self.bias_hh)
        if not batched:
            h2, c2 = op("aten::squeeze", h2, 0), op("aten::squeeze", c2, 0)
        return h2, c2


class GRUCell(_CellBase):
    """One GRU step: `h' = cell(x, h)`."""

    _GATES = 3

    def forward(self, input, hx=None):  # noqa: A002
        x, h, batched = self._prepare(input, hx)
        h2 = _gru_cell(F.linear(x, self.weight_ih, self.bias_ih), h, self.weight_hh, self.bias_hh)
        return h2 if batched else op("aten::squeeze", h2, 0)


class RNNCell(_CellBase):
    """One Elman step: `h' = tanh(x W_ih.T + b_ih + h W_hh.T + b_hh)`."""

    def __init__(self, input_size, hidden_size, bias=True, nonlinearity="tanh", device=None, dtype=None):
        super().__init__(input_size, hidden_size, bias)
        self.nonlinearity = nonlinearity

    def forward(self, input, hx=None):  # noqa: A002
        x, h, batched = self._prepare(input, hx)
        h2 = _rnn_cell(F.linear(x, self.weight_ih, self.bias_ih), h, self.weight_hh, self.bias_hh,
                       self.nonlinearity)
        return h2 if batched else op("aten::squeeze", h2, 0)
