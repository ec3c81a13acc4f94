"""Small deterministic params, grads and models shared by the tests of mptrain.optim."""
import torch

SHAPES = [(7, 3), (5,), (1,), (33, 2)]


def params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in SHAPES]


def grads(step, dtype=torch.float32, shapes=SHAPES):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def batch(step):
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def loss_of(net, step):
    x, y = batch(step)
    dtype = next(net.parameters()).dtype
    return torch.nn.functional.mse_loss(net(x.to(dtype)).float(), y)


def train(net, opt, steps, start=0):
    for k in range(start, start + steps):
        opt.zero_grad()
        loss_of(net, k).backward()
        opt.step()


def assert_same(a_list, b_list, tol=0.0):
    for a, b in zip(a_list, b_list):
        if tol == 0.0:
            assert torch.equal(a.detach(), b.detach()), (a, b)
        else:
            torch.testing.assert_close(a.detach().float(), b.detach().float(), rtol=tol, atol=tol)
