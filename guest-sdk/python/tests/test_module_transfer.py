"""Modules as RPC values (`wasmrpc/nn/_transfer.py`) and the kit's
`wasmrpc.torchvision` ResNets, through the fake host in `fakehost.py`.

A module travels by value as the record `wasmrpc.Module`, as data: these
tests send a model and check what arrives (class, parameter order and
values, `requires_grad`, buffers, mode, forward output), and refuse what a
hostile sender could put in one. The ResNets are checked against
torchvision's own with the same weights, forward and backward.

Run:

    cd guest-sdk/python && /root/.cache/wasmrpc/torch-2.13.0/bin/python -m unittest discover -s tests -v
"""

import unittest

import fakehost

HOST = fakehost.install()
T = fakehost.T

import torch as real  # noqa: E402
import torchvision as real_vision  # noqa: E402

from wasmrpc import _values, torch, torchvision  # noqa: E402
from wasmrpc.nn import _transfer  # noqa: E402
from wasmrpc.tensor import Tensor  # noqa: E402

nn = torch.nn


def kit(t):
    return HOST.to_kit(t.detach().clone())


def back(t):
    return HOST.to_torch(t)


def send(obj):
    """What arrives when `obj` is sent: its nodes (each handle a copy the
    receiver owns), decoded."""
    return _values.from_nodes(_values.to_nodes(obj, T, move=True), T)


class Net(nn.Module):
    """A plugin's own model: its class is found in this module."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.bn = nn.BatchNorm2d(2)
        self.fc = nn.Linear(8, 3)
        self.scale = 0.5
        self.kernel = (3, 3)

    def forward(self, x):
        x = self.bn(self.conv(x)).relu()
        return self.fc(torch.flatten(x, 1)) * self.scale


def record(fields, name=_transfer.MODULE):
    """The nodes of a record `name` with `fields` (values encoded as usual)."""
    return _values.to_nodes(_values.Record(name, list(fields.items())), T, move=True)


def good_fields():
    return _transfer.to_record(nn.Linear(2, 2))


class Transfer(unittest.TestCase):
    def test_a_model_arrives_whole(self):
        net = Net()
        net.eval()
        x = kit(real.randn(2, 1, 4, 4))
        got = send(net)
        self.assertIs(type(got), Net)
        self.assertIsNot(got, net)
        self.assertEqual([n for n, _ in got.named_parameters()], [n for n, _ in net.named_parameters()])
        for (_, a), (_, b) in zip(got.named_parameters(), net.named_parameters()):
            self.assertIs(type(a), nn.Parameter)
            self.assertTrue(a.requires_grad)
            self.assertTrue(real.equal(back(a), back(b)))
        self.assertEqual(sorted(got.state_dict()), sorted(net.state_dict()))
        self.assertFalse(got.training)
        self.assertEqual((got.scale, got.kernel), (0.5, (3, 3)))
        self.assertTrue(real.allclose(back(got(x)), back(net(x))))

    def test_a_frozen_parameter_stays_frozen(self):
        lin = nn.Linear(2, 2)
        lin.bias.requires_grad_(False)
        got = send(lin)
        self.assertTrue(got.weight.requires_grad)
        self.assertFalse(got.bias.requires_grad)

    def test_a_resnet_with_its_norm_layer_class(self):
        m = torchvision.models.resnet18(num_classes=5)
        got = send(m)
        self.assertIs(got._norm_layer, nn.BatchNorm2d)
        self.assertEqual(len(list(got.parameters())), len(list(m.parameters())))
        x = kit(real.randn(1, 3, 32, 32))
        m.eval()
        got.eval()
        self.assertTrue(real.allclose(back(got(x)), back(m(x)), atol=1e-5))

    def test_a_function_attribute_is_refused_when_sent(self):
        net = Net()
        net.act = torch.relu
        with self.assertRaisesRegex(TypeError, "its attribute 'act' is a function"):
            _values.to_nodes(net, T)

    def test_a_class_it_does_not_have_is_refused(self):
        for name in ("os:system", "builtins:object", "wasmrpc.nn.modules:Nothing", "nomodule", "a:b.__class__"):
            fields = good_fields()
            fields["class"] = name
            with self.assertRaises(ValueError, msg=name):
                _values.from_nodes(record(fields), T)
        with self.assertRaisesRegex(ValueError, "which this plugin does not have"):
            _values.from_nodes(record({"class": "builtins:object"}, _transfer.MODULE_CLASS), T)

    def test_hostile_state_is_refused(self):
        cases = {
            "a parameter that is a plain tensor": ("parameters", {"weight": kit(real.zeros(2, 2))}),
            "a buffer that is not a tensor": ("buffers", {"running_mean": 3}),
            "a child that is not a module": ("modules", {"sub": "x"}),
            "a dunder attribute": ("attributes", {"__class__": 1}),
            "a table as an attribute": ("attributes", {"_parameters": {}}),
            "a non-string name": ("parameters", {1: None}),
            "non-persistent names that are no buffers": ("non_persistent", ["nope"]),
            "a mode that is not a bool": ("training", "yes"),
        }
        for what, (key, value) in cases.items():
            fields = good_fields()
            fields[key] = value
            with self.assertRaises(ValueError, msg=what):
                _values.from_nodes(record(fields), T)
        fields = good_fields()
        del fields["attributes"]
        with self.assertRaisesRegex(ValueError, "has the fields"):
            _values.from_nodes(record(fields), T)
        with self.assertRaisesRegex(ValueError, "a tensor `data` and a bool"):
            _values.from_nodes(record({"data": 1, "requires_grad": True}, _transfer.PARAMETER), T)

    def test_a_function_reference_attribute_is_refused_when_received(self):
        fields = good_fields()
        fields["attributes"] = {"forward": torch.relu}
        with self.assertRaisesRegex(ValueError, "its attribute 'forward' is not data"):
            _values.from_nodes(record(fields), T)


class ResNets(unittest.TestCase):
    def same(self, kit_model, real_model, size):
        kit_model.load_state_dict({k: kit(v) for k, v in real_model.state_dict().items()})
        self.assertEqual(list(kit_model.state_dict()), list(real_model.state_dict()))
        x = real.randn(2, 3, size, size)
        out, want = kit_model(kit(x)), real_model(x)
        self.assertTrue(real.allclose(back(out), want, atol=1e-4, rtol=1e-4))
        (out ** 2).sum().backward()
        (want ** 2).sum().backward()
        grads = dict(real_model.named_parameters())
        for name, p in kit_model.named_parameters():
            self.assertTrue(real.allclose(back(p.grad), grads[name].grad, atol=1e-3, rtol=1e-3), name)
        # Training mode updated the running statistics alike.
        for name, b in kit_model.named_buffers():
            self.assertTrue(real.allclose(back(b).double(), dict(real_model.named_buffers())[name].double(),
                                          atol=1e-4), name)

    def test_resnet18(self):
        self.same(torchvision.models.resnet18(num_classes=7), real_vision.models.resnet18(num_classes=7), 32)

    def test_resnet50(self):
        self.same(torchvision.models.resnet50(num_classes=30), real_vision.models.resnet50(num_classes=30), 32)

    def test_initialisation_follows_torchvision(self):
        m = torchvision.models.resnet50(num_classes=30)
        self.assertEqual(sum(p.numel() for p in m.parameters()),
                         sum(p.numel() for p in real_vision.models.resnet50(num_classes=30).parameters()))
        self.assertTrue(real.equal(back(m.bn1.weight), real.ones(64)))
        # kaiming_normal_(mode="fan_out", nonlinearity="relu"): std sqrt(2 / (64 * 7 * 7)).
        std = back(m.conv1.weight).std().item()
        self.assertAlmostEqual(std, (2 / (64 * 49)) ** 0.5, delta=0.005)

    def test_pretrained_weights_are_refused(self):
        with self.assertRaisesRegex(NotImplementedError, "cannot be downloaded"):
            torchvision.models.resnet18(weights="IMAGENET1K_V1")


if __name__ == "__main__":
    unittest.main()
