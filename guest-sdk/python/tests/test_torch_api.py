"""The kit's PyTorch surface (`wasmrpc.torch`, `torch.nn`, `torch.optim`)
against torch itself, through the fake host in `fakehost.py` (real torch
tensors behind the kit's handles; the wasm path is not exercised).

Run:

    cd guest-sdk/python && /root/.cache/wasmrpc/torch-2.13.0/bin/python -m unittest discover -s tests -v
"""

import unittest

import fakehost

HOST = fakehost.install()

import torch as real  # noqa: E402

from wasmrpc import futures, optim as dist_optim  # noqa: E402
from wasmrpc import torch  # noqa: E402
from wasmrpc.tensor import Tensor  # noqa: E402

nn = torch.nn
F = torch.nn.functional
optim = torch.optim
TOL = 1e-5


def kit(t):
    return HOST.to_kit(t.detach().clone())


def back(t):
    return HOST.to_torch(t)


class Case(unittest.TestCase):
    def close(self, kit_t, torch_t, tol=TOL):
        got = back(kit_t) if isinstance(kit_t, Tensor) else kit_t
        self.assertEqual(tuple(got.shape), tuple(torch_t.shape))
        self.assertTrue(real.allclose(got.detach().double(), torch_t.detach().double(), atol=tol, rtol=tol),
                        f"\n{got}\n!=\n{torch_t}")

    def same_module(self, kmod, tmod, *inputs, out=lambda o: o):
        """Copies `tmod`'s weights into `kmod`, runs both on `inputs`,
        compares outputs and the parameters' gradients."""
        kmod.load_state_dict({k: kit(v) for k, v in tmod.state_dict().items()})
        tout = out(tmod(*inputs))
        kout = out(kmod(*[kit(i) if isinstance(i, real.Tensor) else i for i in inputs]))
        self.close(kout, tout)
        (tout.float() ** 2).sum().backward()
        (kout.float() ** 2).sum().backward()
        tgrads = dict(tmod.named_parameters())
        for name, p in kmod.named_parameters():
            self.close(p.grad, tgrads[name].grad)
        return kout, tout


class Layers(Case):
    def test_linear(self):
        self.same_module(nn.Linear(5, 3), real.nn.Linear(5, 3), real.randn(4, 5))

    def test_conv2d_pool_flatten(self):
        km = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())
        tm = real.nn.Sequential(real.nn.Conv2d(2, 3, 3, padding=1), real.nn.ReLU(), real.nn.MaxPool2d(2),
                                real.nn.Flatten())
        self.same_module(km, tm, real.randn(2, 2, 6, 6))

    def test_conv1d(self):
        self.same_module(nn.Conv1d(2, 4, 3, stride=2), real.nn.Conv1d(2, 4, 3, stride=2), real.randn(3, 2, 9))

    def test_lstm(self):
        for kw in (dict(), dict(batch_first=True, num_layers=2), dict(bidirectional=True)):
            with self.subTest(**kw):
                km, tm = nn.LSTM(4, 5, **kw), real.nn.LSTM(4, 5, **kw)
                x = real.randn(3, 6, 4)
                self.same_module(km, tm, x, out=lambda o: o[0])
                ko, (kh, kc) = km(kit(x))
                to, (th, tc) = tm(x)
                self.close(kh, th)
                self.close(kc, tc)

    def test_gru_and_rnn(self):
        x = real.randn(5, 2, 3)
        self.same_module(nn.GRU(3, 4, num_layers=2), real.nn.GRU(3, 4, num_layers=2), x, out=lambda o: o[0])
        self.same_module(nn.RNN(3, 4), real.nn.RNN(3, 4), x, out=lambda o: o[1])
        ko, kh = nn.GRU(3, 4)(kit(x))
        self.assertEqual(tuple(kh.shape), (1, 2, 4))

    def test_embedding(self):
        idx = real.tensor([[0, 2, 1], [3, 3, 0]])
        self.same_module(nn.Embedding(4, 3, padding_idx=0), real.nn.Embedding(4, 3, padding_idx=0), idx)

    def test_batchnorm1d_running_stats(self):
        km, tm = nn.BatchNorm1d(3), real.nn.BatchNorm1d(3)
        x = real.randn(8, 3)
        self.same_module(km, tm, x)
        self.close(km.running_mean, tm.running_mean)
        self.close(km.running_var, tm.running_var)
        self.assertEqual(km.num_batches_tracked.item(), 1)
        km.eval()
        tm.eval()
        self.close(km(kit(x)), tm(x))

    def test_layernorm(self):
        self.same_module(nn.LayerNorm(6), real.nn.LayerNorm(6), real.randn(2, 3, 6))

    def test_dropout_train_eval(self):
        d = nn.Dropout(0.5)
        x = torch.ones(1000)
        y = d(x)
        zeros = (y == 0).sum().item()
        self.assertTrue(300 < zeros < 700)
        d.eval()
        self.assertEqual((d(x) == 1).sum().item(), 1000)

    def test_losses(self):
        logits, target = real.randn(5, 4, requires_grad=True), real.tensor([0, 3, 1, 1, 2])
        kl = kit(logits).requires_grad_()
        kloss = F.cross_entropy(kl, kit(target))
        tloss = real.nn.functional.cross_entropy(logits, target)
        self.close(kloss, tloss)
        kloss.backward()
        tloss.backward()
        self.close(kl.grad, logits.grad)
        a, b = real.randn(3, 2), real.randn(3, 2)
        self.close(F.mse_loss(kit(a), kit(b)), real.nn.functional.mse_loss(a, b))
        self.close(nn.L1Loss(reduction="sum")(kit(a), kit(b)), real.nn.L1Loss(reduction="sum")(a, b))
        self.close(nn.NLLLoss()(F.log_softmax(kit(a), 1), kit(real.tensor([0, 1, 1]))),
                   real.nn.NLLLoss()(real.log_softmax(a, 1), real.tensor([0, 1, 1])))
        p, t = real.rand(4), real.tensor([0.0, 1.0, 1.0, 0.0])
        self.close(nn.BCELoss()(kit(p), kit(t)), real.nn.BCELoss()(p, t))
        self.close(nn.BCEWithLogitsLoss()(kit(a), kit(b.sigmoid())), real.nn.BCEWithLogitsLoss()(a, b.sigmoid()))
        self.close(F.one_hot(kit(target), 4), real.nn.functional.one_hot(target, 4))
        self.close(F.gelu(kit(a)), real.nn.functional.gelu(a))
        self.close(F.softmax(kit(a), dim=1), real.softmax(a, 1))

    def test_default_init_in_distribution(self):
        w = nn.Linear(400, 300).weight
        bound = 1 / 400**0.5
        t = back(w)
        self.assertLessEqual(t.abs().max().item(), bound + 1e-6)
        self.assertAlmostEqual(t.std().item(), bound / 3**0.5, delta=0.01 * bound)
        e = back(nn.Embedding(100, 100).weight)
        self.assertAlmostEqual(e.std().item(), 1.0, delta=0.05)


class ModuleApi(Case):
    def test_registration_and_state(self):
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.body = nn.Sequential(nn.Linear(2, 3), nn.Tanh())
                self.heads = nn.ModuleDict({"a": nn.Linear(3, 1)})
                self.extra = nn.Parameter(torch.zeros(2))
                self.register_buffer("count", torch.zeros(1))
                self.register_buffer("scratch", torch.zeros(1), persistent=False)

            def forward(self, x):
                return self.heads["a"](self.body(x))

        n = Net()
        names = [k for k, _ in n.named_parameters()]
        self.assertEqual(names, ["extra", "body.0.weight", "body.0.bias", "heads.a.weight", "heads.a.bias"])
        self.assertEqual(list(n.state_dict()), names[:1] + ["count"] + names[1:])
        self.assertEqual(len(list(n.modules())), 6)
        self.assertEqual(len(list(n.children())), 2)
        n.eval()
        self.assertFalse(n.body[0].training)
        n.train()
        self.assertTrue(n.heads["a"].training)
        self.assertIs(n.to("cpu"), n)
        seen = []
        n.apply(lambda m: seen.append(type(m).__name__))
        self.assertEqual(seen[-1], "Net")
        with self.assertRaises(RuntimeError):
            n.load_state_dict({"extra": torch.zeros(2)})
        missing, unexpected = n.load_state_dict({"extra": torch.ones(2)}, strict=False)
        self.assertIn("count", missing)
        self.assertEqual(n.extra.tolist(), [1.0, 1.0])

    def test_zero_grad_and_writable_grad(self):
        m = nn.Linear(2, 1)
        m(torch.ones(1, 2)).sum().backward()
        self.assertIsNotNone(m.weight.grad)
        m.zero_grad()
        self.assertIsNone(m.weight.grad)
        m.weight.grad = torch.full((1, 2), 3.0)
        self.assertEqual(m.weight.grad.tolist(), [[3.0, 3.0]])


class Optimizers(Case):
    def run_both(self, make_kit, make_torch, steps=5):
        real.manual_seed(0)
        ps = [real.randn(3, 2, requires_grad=True), real.randn(2, requires_grad=True)]
        kps = [nn.Parameter(kit(p)) for p in ps]
        kopt, topt = make_kit(kps), make_torch(ps)
        for step in range(steps):
            grads = [real.randn(p.shape) for p in ps]
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            for p, g in zip(kps, grads):
                p.grad = kit(g)
            topt.step()
            kopt.step()
            for kp, p in zip(kps, ps):
                self.close(kp, p)

    def test_sgd(self):
        for kw in (dict(lr=0.1), dict(lr=0.1, momentum=0.9), dict(lr=0.05, momentum=0.9, nesterov=True,
                                                                   weight_decay=0.01),
                   dict(lr=0.1, momentum=0.5, dampening=0.3)):
            with self.subTest(**kw):
                self.run_both(lambda p: optim.SGD(p, **kw), lambda p: real.optim.SGD(p, **kw))

    def test_adam_adamw(self):
        for kw in (dict(lr=0.01), dict(lr=0.01, weight_decay=0.1, amsgrad=True)):
            with self.subTest(**kw):
                self.run_both(lambda p: optim.Adam(p, **kw), lambda p: real.optim.Adam(p, **kw))
        self.run_both(lambda p: optim.AdamW(p, lr=0.01), lambda p: real.optim.AdamW(p, lr=0.01))

    def test_param_groups_and_scheduler(self):
        a, b = nn.Parameter(torch.ones(1)), nn.Parameter(torch.ones(1))
        opt = optim.SGD([{"params": [a]}, {"params": [b], "lr": 1.0}], lr=0.1)
        a.grad, b.grad = torch.ones(1), torch.ones(1)
        opt.step()
        self.assertAlmostEqual(a.item(), 0.9, places=6)
        self.assertAlmostEqual(b.item(), 0.0, places=6)
        sched = optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        sched.step()
        sched.step()
        self.assertEqual(sched.get_last_lr(), [0.05, 0.5])
        self.assertEqual(opt.state_dict()["param_groups"][1]["params"], [1])
        opt.zero_grad()
        self.assertIsNone(a.grad)

    def test_distributed_optimizer_names_kept(self):
        self.assertEqual(dist_optim.SGD(0.5).config[0], "sgd")
        self.assertTrue(hasattr(dist_optim, "DistributedOptimizer"))


class Indexing(Case):
    def test_getitem(self):
        t = real.arange(60.0).reshape(3, 4, 5)
        k = kit(t)
        idx = real.tensor([2, 0])
        for index in (0, -1, slice(0, 2), (slice(None), 1), (Ellipsis, -1), None, (None, 1), (1, slice(None, None, 2)),
                      (slice(1, None), Ellipsis, slice(0, 3))):
            with self.subTest(index=index):
                self.close(k[index], t[index])
        self.close(k[kit(idx)], t[idx])
        self.close(k[:, kit(idx)], t[:, idx])
        self.close(k[[0, 2]], t[[0, 2]])
        mask = t[:, 0, 0] > 10
        self.close(k[kit(mask)], t[mask])
        self.close(k[k > 30], t[t > 30])

    def test_setitem(self):
        t = real.zeros(3, 4)
        k = kit(t.clone())
        for index, value in ((0, 1.0), ((slice(None), 1), 2.0), ((1, slice(1, 3)), real.tensor([5.0, 6.0])),
                             (real.tensor([2, 0]), 7.0), (Ellipsis, None)):
            if value is None:
                continue
            t[index] = value
            kindex = kit(index) if isinstance(index, real.Tensor) else index
            k[kindex] = kit(value) if isinstance(value, real.Tensor) else value
            self.close(k, t)
        t[t > 5] = -1.0
        k[k > 5] = -1.0
        self.close(k, t)

    def test_tensor_surface(self):
        t = real.tensor([[1.0, -2.0], [3.0, 4.0]])
        k = kit(t)
        self.close(2 / k, 2 / t)
        self.close(2 ** k, 2 ** t)
        self.close(1 - k, 1 - t)
        self.close(k @ k.T, t @ t.T)
        self.close(k < 2, t < 2)
        self.close(k != 3, t != 3)
        self.assertEqual(len(k), 2)
        self.assertEqual([r.tolist() for r in k], t.tolist())
        self.assertEqual(k.shape, (2, 2))
        self.assertEqual(repr(k.shape), "torch.Size([2, 2])")
        self.assertEqual(k[1, 1].item(), 4.0)
        self.assertEqual(str(k.device), "cpu")
        self.assertIs(k.long().dtype, torch.long)
        self.assertIs(k.to(torch.int32).dtype, torch.int32)
        self.assertIs(k.float().dtype, torch.float32)
        self.close(k.permute(1, 0), t.permute(1, 0))


class Namespace(Case):
    def test_dtypes(self):
        self.assertIs(torch.float32, torch.float)
        self.assertIs(torch.long, torch.int64)
        self.assertEqual(repr(torch.float32), "torch.float32")
        self.assertEqual(torch.ones(2).dtype, "float32")
        self.assertTrue(torch.float64.is_floating_point)
        self.assertIs(torch.tensor([1, 2]).dtype, torch.int64)
        self.assertIs(torch.tensor([True]).dtype, torch.bool)
        self.assertIs(torch.tensor([1, 2.5]).dtype, torch.float32)

    def test_factories(self):
        self.assertEqual(torch.randn(4, 6, 3).shape, (4, 6, 3))
        z = torch.zeros((2, 3), dtype=torch.long)
        self.assertIs(z.dtype, torch.int64)
        self.assertEqual(torch.ones_like(z).tolist(), [[1] * 3] * 2)
        self.assertEqual(torch.arange(1, 4).tolist(), [1, 2, 3])
        self.assertEqual(torch.full((2,), 7).tolist(), [7, 7])
        self.assertIs(torch.LongTensor(3).dtype, torch.long)
        self.assertEqual(torch.LongTensor([1, 2]).tolist(), [1, 2])
        self.assertIs(torch.FloatTensor([1, 2]).dtype, torch.float32)
        self.assertTrue(torch.zeros(2, requires_grad=True).requires_grad)
        self.assertEqual(torch.tensor([[1, 2]], dtype=torch.float64).dtype, "float64")
        self.assertEqual(torch.cat([torch.ones(1), torch.zeros(1)]).tolist(), [1.0, 0.0])
        with self.assertRaises(NotImplementedError):
            torch.manual_seed(0)

    def test_attribute_errors(self):
        with self.assertRaisesRegex(AttributeError, "no attribute 'cuda'.*CPU"):
            torch.cuda
        with self.assertRaisesRegex(AttributeError, "no attribute 'Generator'.*any aten op"):
            torch.Generator
        with self.assertRaisesRegex(AttributeError, "wasmrpc.save"):
            torch.save
        self.assertEqual(torch.relu.__wasmrpc_name__, "aten::relu")
        self.assertIs(torch.futures.wait_all, futures.wait_all)

    def test_grad_mode(self):
        self.assertTrue(torch.is_grad_enabled())
        with torch.no_grad():
            self.assertFalse(torch.is_grad_enabled())
            with torch.enable_grad():
                self.assertTrue(torch.is_grad_enabled())
            self.assertFalse(torch.is_grad_enabled())
        self.assertTrue(torch.is_grad_enabled())

        @torch.no_grad()
        def f():
            return torch.is_grad_enabled()

        @torch.no_grad
        def g():
            return torch.is_grad_enabled()

        self.assertFalse(f())
        self.assertFalse(g())
        self.assertTrue(torch.is_grad_enabled())
        x = torch.ones(2, requires_grad=True)
        self.assertFalse(x.detach().requires_grad)


class Training(Case):
    def test_brief_loop_learns(self):
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(64, 32)
                self.fc2 = nn.Linear(32, 10)
                self.drop = nn.Dropout(0.1)

            def forward(self, x):
                return self.fc2(self.drop(F.relu(self.fc1(x))))

        g = real.Generator().manual_seed(1)
        xs = real.randn(80, 64, generator=g)
        ys = xs[:, :10].argmax(1)
        batches = [(kit(xs[i:i + 16]), kit(ys[i:i + 16])) for i in range(0, 80, 16)]
        model = Net()
        opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        first = None
        for epoch in range(15):
            for x, y in batches:
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                first = loss.item() if first is None else first
        model.eval()
        with torch.no_grad():
            acc = (model(kit(xs)).argmax(1) == kit(ys)).float().mean().item()
        self.assertLess(loss.item(), first / 3)
        self.assertGreater(acc, 0.9)


if __name__ == "__main__":
    unittest.main()
