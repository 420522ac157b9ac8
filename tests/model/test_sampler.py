"""The sampler against the distribution it should draw from."""
import torch

from devharness.kernels import reference
from devharness.model.sampler import LogitBias, SamplingBatch, add_logit_bias, sample as sample_with, token_seed


def sample(logits, batch):
    return sample_with(logits, batch, reference.argmax)


def batch(n, temperature=1.0, top_k=None, top_p=1.0, seeds=None, logprobs=None):
    return SamplingBatch([temperature] * n, [top_k] * n, [top_p] * n,
                         seeds if seeds is not None else [token_seed(1, i) for i in range(n)], [logprobs] * n)


def test_greedy_is_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    tokens, _ = sample(logits, batch(5, temperature=0.0))
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_greedy_takes_the_first_of_tied_maxima():
    """As transformers' argmax does, whatever reduction the sampler uses; ties across a vocabulary wide enough
    for the CPU's vectorized and parallel reductions."""
    logits = torch.zeros(3, 49152)
    logits[0, [5, 40000]] = 1.0
    logits[1, [30000, 49151]] = 2.0
    logits[2, :] = 0.5                      # every token tied
    tokens, _ = sample(logits, batch(3, temperature=0.0))
    assert tokens.tolist() == [5, 30000, 0]


def test_frequencies_follow_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0]).repeat(4000, 1)
    tokens, _ = sample(logits, batch(4000, temperature=1.0, seeds=[token_seed(s, 0) for s in range(4000)]))
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    expected = torch.softmax(logits[0], -1)
    assert (freq - expected).abs().max() < 0.03, (freq, expected)


def test_top_k_and_top_p_restrict_support():
    logits = torch.tensor([3.0, 2.9, 2.8, 0.0, -1.0]).repeat(500, 1)
    seeds = [token_seed(s, 0) for s in range(500)]
    t, _ = sample(logits, batch(500, top_k=2, seeds=seeds))
    assert set(t.tolist()) == {0, 1}
    probs = torch.softmax(logits[0], -1)       # 0.36, 0.33, 0.30, ...: top_p 0.5 keeps the first two
    t, _ = sample(logits, batch(500, top_p=0.5, seeds=seeds))
    assert set(t.tolist()) == {0, 1} and probs[0] < 0.5
    t, _ = sample(logits, batch(500, top_p=0.01, seeds=seeds))
    assert set(t.tolist()) == {0}


def test_same_seed_same_token_regardless_of_row():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(1))
    alone, _ = sample(logits, batch(1, seeds=[token_seed(42, 3)]))
    crowd = torch.cat([torch.randn(6, 100), logits])
    together, _ = sample(crowd, batch(7, seeds=[token_seed(i, 0) for i in range(6)] + [token_seed(42, 3)]))
    assert together[-1] == alone[0]


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = torch.randn(2, 10)
    _, lp = sample(logits, batch(2, temperature=0.0, logprobs=3))
    assert torch.allclose(lp, torch.log_softmax(logits, -1))


def test_logit_bias_as_one_tensor_adds_what_a_loop_adds():
    """add_logit_bias (every biased row in one index_put_) against a Python loop over each row's dict: the same
    float32 logits, rows without a bias untouched, a whole-vocabulary bias included."""
    gen = torch.Generator().manual_seed(3)
    vocab, n = 264, 12
    logits = torch.randn(n, vocab, generator=gen)
    biases = {}
    for row in range(0, n, 2):   # odd rows have none
        k = vocab if row == 0 else int(torch.randint(1, 40, (1,), generator=gen))
        ids = torch.randperm(vocab, generator=gen)[:k].tolist()
        values = (torch.rand(k, generator=gen) * 200 - 100).tolist()
        biases[row] = dict(zip(ids, values))
    expected = logits.clone()
    for row, bias in biases.items():
        for t, b in bias.items():
            expected[row, t] += torch.tensor(b, dtype=torch.float32)
    got = logits.clone()
    add_logit_bias(got, list(biases), [LogitBias.of(b, got.device) for b in biases.values()])
    assert torch.equal(got, expected)
    assert not torch.equal(got, logits)
    untouched = logits.clone()
    add_logit_bias(untouched, [], [])
    assert torch.equal(untouched, logits)
