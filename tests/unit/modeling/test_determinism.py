import torch

from rlhf_async.modeling.collectives import all_gather_1d, all_reduce_grads, all_reduce_sum, world
from rlhf_async.modeling.determinism import key_seed, keyed_order, keyed_uniform


def test_key_seed_is_stable_and_distinguishes_parts():
    assert key_seed(0, "a", 1) == key_seed(0, "a", 1)
    assert len({key_seed(0, "a", 1), key_seed(1, "a", 1), key_seed(0, "a", 2),
                key_seed(0, "b", 1)}) == 4
    assert 0 <= key_seed(123, "x") < 2**63


def test_keyed_uniform_rows_depend_only_on_their_id():
    a = keyed_uniform(0, ("s", 3), [5, 6, 7], (2, 4))
    b = keyed_uniform(0, ("s", 3), [7, 5], (2, 4))
    assert torch.equal(a[2], b[0]) and torch.equal(a[0], b[1])
    assert a.min() > 0 and a.max() < 1 and a.shape == (3, 2, 4)


def test_keyed_order_ignores_input_order():
    ids = list(range(20))
    assert keyed_order(0, ("mb", 1), ids) == keyed_order(0, ("mb", 1), ids[::-1])
    assert keyed_order(0, ("mb", 1), ids) != keyed_order(0, ("mb", 2), ids)


def test_collectives_are_identity_without_distributed():
    t = torch.tensor([1.0, 2.0])
    assert world() == (0, 1)
    assert torch.equal(all_reduce_sum(t), t) and torch.equal(all_gather_1d(t), t)
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([0.5, 0.25])
    all_reduce_grads([p])
    assert torch.equal(p.grad, torch.tensor([0.5, 0.25]))
