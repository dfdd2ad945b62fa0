#!/usr/bin/env python3
"""The float32 training backward's gradient of a one-element `other` on
random draws of test_layouts' channels-last-odd-c case (x[4, 13, 6, 6]
channels-last), on CUDA: the relative error against float64 of the fused
op, of eager, and of float64 evaluations with the float32-rounded and the
exact invstd (docs/kernels/batch_norm_add_div_swish.md).

    source env.sh && python bench/bn_grad_other_draws.py
"""
import torch, torchfuse
ops = torch.ops.torchfuse
EPS = 1e-5
g = torch.Generator(device="cuda"); g.manual_seed(1)
rows = []
for it in range(400):
    r = lambda *s, sc=1.0, m=0.0: torch.randn(*s, generator=g, device="cuda") * sc + m
    x = r(4, 13, 6, 6).contiguous(memory_format=torch.channels_last)
    w, b, o, gy = r(13, sc=0.5, m=1.0), r(13), r(1), r(4, 13, 6, 6).contiguous(memory_format=torch.channels_last)
    rm, rv = torch.zeros(13, device="cuda"), torch.ones(13, device="cuda")
    def run(fn, dt):
        xs, ws, bs, os_ = [t.to(dt).detach().requires_grad_(True) for t in (x, w, b, o)]
        out = fn(xs, ws, bs, rm.clone().to(dt), rv.clone().to(dt), os_)
        out.backward(gy.to(dt)); return os_.grad.double().item()
    eag = lambda x, w, b, rm, rv, o: (lambda t: t * torch.sigmoid(t))((torch.batch_norm(x, w, b, rm, rv, True, 0.1, EPS, True) + o) / 1.0)
    fus = lambda x, w, b, rm, rv, o: ops.custom_batch_norm_add_div_swish(x, w, b, rm, rv, True, 0.1, EPS, o, 1.0, False)
    ref = run(eag, torch.float64); e = run(eag, torch.float32); f = run(fus, torch.float32)
    xd = x.double(); mean = xd.mean((0, 2, 3)); inv = 1 / torch.sqrt(xd.var((0, 2, 3), unbiased=False) + EPS)
    def sim(inv):
        t = (xd - mean.view(1, -1, 1, 1)) * (w.double() * inv).view(1, -1, 1, 1) + (b.double() + o.double()).view(1, -1, 1, 1)
        s = torch.sigmoid(t); gd = gy.double(); return (gd * s + gd * t * (1 - s) * s).sum().item()
    er = lambda v: abs(v - ref) / abs(ref)
    rows.append((er(f), er(e), er(sim(inv.float().double())), er(sim(inv))))
t = torch.tensor(rows)
bound = 2 * t[:, 1] + 1e-6
print("violations fused", int((t[:, 0] > bound).sum()), "sim f32 invstd", int((t[:, 2] > bound).sum()), "of", len(rows))
print("median err: fused %.2e eager %.2e sim_f32inv %.2e sim_exact %.2e" % tuple(t.median(0).values.tolist()))
print("max ratio fused/bound %.3f, sim/bound %.3f" % ((t[:, 0] / bound).max(), (t[:, 2] / bound).max()))
print("corr fused vs sim_f32inv", torch.corrcoef(torch.stack([t[:, 0], t[:, 2]]))[0, 1].item())
