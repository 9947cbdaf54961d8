"""The CPU kernels (core/runtime/kernels/): each computes its function (against float64 references of the
same arithmetic), and a row's result is the same floats whatever rows share the call, however many threads run and
wherever its keys sit in the cache. The decoder built on them therefore gives a token verified inside a tree — in the
layouts TreeBuilder really builds — bit for bit the logits a one-token step gives it; with bf16 weights it rounds its
activations to bf16 where a bf16 model does, and computes what PyTorch's bf16 model computes."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import make_tiny_checkpoint
from core.runtime.kernels import build, cpu
from core.runtime.kv_cache import key_slots, tile_keys
from core.runtime.loading import load_model
from core.runtime.weights import BLOCK, from_blocks, from_gguf_blocks, pack, quantize_q4_1, quantize_q8_0
from core.tokenswift.tree import HEADS, TreeBuilder

FORMATS = ("f32", "bf16", "q8_0", "q4_1")
WEIGHTS = ("fp32", "bf16", "q8", "q4")  # --weights choices that pack a checkpoint's matrices for the kernels


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if cpu.kernel() is None:
        pytest.fail("the CPU kernels did not build (a C++ compiler and ninja are requirements)")


def reference_linear(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    """float64 y = x W^T (+ b) with the kernel's arithmetic: fp32 activations for fp32 and bf16 weights; for quantized
    weights the activations quantized per block of 32 (d = max|x| / 127, q = round(x * 127 / max|x|), ties to even)
    and the blocks' exact integer dot products."""
    wd = w.dequantize().double()
    if w.fmt in ("f32", "bf16"):
        y = x.double() @ wd.T
    else:
        r, k = x.shape
        blocks = x.view(r, k // BLOCK, BLOCK)
        amax = blocks.abs().amax(-1)
        inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
        q = torch.round(blocks * inv[..., None]).clamp(-127, 127)
        xq = (q.double() * (amax / 127).double()[..., None]).view(r, k)
        y = xq @ wd.T
    return y + (bias.double() if bias is not None else 0)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536), (50, 64), (7, 32)])
def test_linear_matches_its_reference(fmt: str, n: int, k: int) -> None:
    torch.manual_seed(n + k)
    w, b = torch.randn(n, k) / k**0.5, torch.randn(n)
    packed = pack(w, fmt, b)
    x = torch.randn(20, k)
    reference = reference_linear(x, packed, b)
    for rows in (1, 2, 5, 6, 7, 13, 20):  # one block, the block sizes, and blocks split near-equally
        out = cpu.linear(x[:rows], packed.kernel_args())
        assert out.shape == (rows, n)
        torch.testing.assert_close(out.double(), reference[:rows], rtol=1e-5, atol=1e-5 * k**0.5)


@pytest.mark.parametrize(("fmt", "bf16"), [(fmt, False) for fmt in FORMATS] + [("bf16", True)])
def test_a_rows_result_does_not_depend_on_the_rows_or_threads_beside_it(fmt: str, bf16: bool) -> None:
    torch.manual_seed(0)
    packed = pack(torch.randn(200, 96), fmt, torch.randn(200))
    x = torch.randn(40, 96)
    together = cpu.linear(x, packed.kernel_args(), bf16)
    for rows in range(1, 41):
        assert torch.equal(cpu.linear(x[:rows], packed.kernel_args(), bf16), together[:rows]), rows
        assert torch.equal(cpu.linear(x[rows - 1:rows], packed.kernel_args(), bf16)[0], together[rows - 1]), rows
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu.linear(x, packed.kernel_args(), bf16), together)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_compute_floors_passes_run_the_whole_linear_layer_on_every_thread(fmt: str) -> None:
    """linear_passes (compute_floor.py times the arithmetic with it) computes the layer's every column, each thread
    its own part, the floats of `linear`, for any number of passes and threads."""
    torch.manual_seed(1)
    packed = pack(torch.randn(200, 96), fmt, torch.randn(200))  # 13 tiles: parts of unequal size on 2 threads
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            for rows in (1, 4, 9):
                x, out = torch.randn(rows, 96), torch.full((rows, 200), float("nan"))
                assert cpu.linear_passes(x, packed.kernel_args(), 3, out) > 0
                assert torch.equal(out, cpu.linear(x, packed.kernel_args())), (t, rows)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_this_cpus_vector_tiles_give_a_linear_layer_the_floats_of_the_portable_loops(monkeypatch) -> None:
    """The build for this CPU's vector unit (register tiles, activations quantized in vectors) against the plain C++
    build of the same source: the same floats in every format, row count and rounding, rounding ties included."""
    if build.isa_level() == "generic":
        pytest.skip("this CPU builds the plain C++ kernels only")
    monkeypatch.setenv("TOKENSWIFT_ISA", "generic")
    portable = build.build("cpu", cpu.SOURCE)  # about two minutes the first time on a machine
    assert portable is not None and portable is not cpu.kernel()
    torch.manual_seed(3)
    x = torch.randn(17, 1536)
    x[0, :32] = torch.arange(32) - 15.5  # d = 15.5 / 127
    x[0, 32:64] = torch.cat([torch.tensor([127.0, -127.0]), torch.arange(30) / 2 - 7.0])  # d = 1: ties (-6.5, ..)
    x[1, :64] = 0.0  # blocks of zeros: d = 0
    for fmt in FORMATS:
        for n, k in ((50, 1536), (200, 96)):
            w = pack(torch.randn(n, k) / k**0.5, fmt, torch.randn(n)).kernel_args()
            for rows in range(1, 18):
                for bf16 in (False, True):
                    assert torch.equal(cpu.linear(x[:rows, :k], w, bf16), portable.linear(x[:rows, :k], *w, bf16)), \
                        (fmt, n, rows, bf16)


def test_quantized_formats_keep_ggmls_numbers() -> None:
    torch.manual_seed(1)
    w = torch.randn(37, 64)
    q, d = quantize_q8_0(w)
    assert torch.equal(pack(w, "q8_0").dequantize(), (d.float().repeat_interleave(BLOCK, 1) * q.float()))
    q4, d4, m4 = quantize_q4_1(w)
    assert q4.max() <= 15 and q4.min() >= 0
    expect = d4.float().repeat_interleave(BLOCK, 1) * q4.float() + m4.float().repeat_interleave(BLOCK, 1)
    packed = pack(w, "q4_1")
    assert torch.equal(packed.dequantize(), expect)
    assert (packed.dequantize() - w).abs().max() <= d4.float().max() / 2 + 1e-3  # within half a step
    for fmt in ("q8_0", "q4_1"):  # blocks out and back in: the same tiles; rows and row lookups agree
        p = pack(w, fmt)
        again = from_blocks(fmt, *p.blocks())
        assert torch.equal(again.data, p.data) and torch.equal(again.d, p.d)
        ids = torch.tensor([0, 36, 17])
        assert torch.equal(p.rows(ids).dequantize(), p.dequantize()[ids])
        assert torch.equal(p.dequantize_rows(ids), p.dequantize()[ids])  # the kernel's lookup
        assert torch.equal(p.unpack_rows(ids), p.dequantize()[ids])  # PyTorch's, where no kernel is built


def test_bf16_weights_stay_bf16_and_compute_as_fp32_tiles_of_the_same_numbers() -> None:
    """A bf16 weight is stored in half of fp32's bytes (nothing widened in memory), and its tile computes bit for bit
    what an fp32 tile of the widened weights computes: widening is exact, the arithmetic is the fp32 tile's."""
    torch.manual_seed(2)
    w, b = torch.randn(37, 80), torch.randn(37)
    rounded = w.to(torch.bfloat16)
    packed = pack(w, "bf16", b)
    assert packed.data.dtype == torch.bfloat16 and packed.nbytes * 2 == pack(w, "f32").nbytes
    assert torch.equal(pack(rounded, "bf16").data, packed.data)  # bf16 weights pack as they are
    assert torch.equal(packed.dequantize(), rounded.float())
    ids = torch.tensor([0, 36, 17])
    assert torch.equal(packed.rows(ids).dequantize(), rounded.float()[ids]) and packed.rows(ids).fmt == "bf16"
    assert torch.equal(packed.dequantize_rows(ids), rounded.float()[ids])
    assert torch.equal(packed.unpack_rows(ids), rounded.float()[ids])
    widened = pack(rounded.float(), "f32", b)
    x = torch.randn(20, 80)
    for rows in (1, 6, 7, 20):
        assert torch.equal(cpu.linear(x[:rows], packed.kernel_args()), cpu.linear(x[:rows], widened.kernel_args()))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def to_bf16(t: torch.Tensor) -> torch.Tensor:
    """PyTorch's rounding of fp32 values to bf16, widened back."""
    return t.bfloat16().float()


def test_bf16_outputs_are_pytorchs_rounding_of_the_fp32_ones() -> None:
    """A rounded linear layer's output is its fp32 output (the accumulation plus the bias) rounded once to bf16 by
    PyTorch's own conversion, bit for bit: ties to even, subnormals, overflow to inf, a NaN. Through an identity
    weight the layer's output is its input (but -0, which the sum from +0 makes +0), so every kind of value can be
    put through the rounding."""
    special = torch.tensor([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20, -(1.0 + 2**-8), 3.3e38,
                            torch.finfo(torch.float32).max, 1e-40, -1e-40, 2**-133, 0.0, 65504.0, 1 / 3])
    torch.manual_seed(5)
    x = torch.cat([special, torch.randn(512 - len(special)) * 10.0 ** torch.randint(-30, 30, (512 - len(special),))])
    x = x.view(-1, 16)
    identity = pack(torch.eye(16), "bf16")
    rounded = cpu.linear(x, identity.kernel_args(), True)
    assert torch.equal(bits(cpu.linear(x, identity.kernel_args())), bits(x))
    assert torch.equal(bits(rounded), bits(to_bf16(x)))
    assert torch.equal(rounded[0, :5], torch.tensor([1.0, 1.0, 1.0 + 2**-6, 1.0 + 2**-7, -1.0]))  # ties to even
    assert torch.isinf(rounded[0, 6]) and (rounded[0, 7:10] != 0).all()
    nan = cpu.linear(torch.full((1, 16), float("nan")), identity.kernel_args(), True)
    assert torch.isnan(nan).all()
    torch.manual_seed(3)
    for fmt in ("bf16", "f32"):  # any weights: the fp32 result rounded, the bias added before
        packed = pack(torch.randn(50, 64), fmt, torch.randn(50))
        y = torch.randn(7, 64)
        assert torch.equal(bits(cpu.linear(y, packed.kernel_args(), True)),
                           bits(to_bf16(cpu.linear(y, packed.kernel_args()))))


def test_bf16_glue_rounds_where_a_bf16_model_rounds() -> None:
    """RMSNorm: the normalised row rounded to bf16, times the (bf16) weight, rounded (model.py's RMSNorm in bf16);
    the SiLU gate: silu(gate) rounded, times up, rounded (F.silu(gate) * up in bf16). Each against the kernel's own
    fp32 value of the unrounded part, rounded by PyTorch: bit for bit."""
    torch.manual_seed(4)
    x = to_bf16(torch.randn(9, 96) * 3)
    w = to_bf16(torch.randn(96))
    normed = cpu.rms_norm(x, torch.ones(96), 1e-5)  # x * rsqrt(mean(x^2) + eps): 1 * y is y
    assert torch.equal(cpu.rms_norm(x, w, 1e-5), w * normed)
    assert torch.equal(bits(cpu.rms_norm(x, w, 1e-5, True)), bits(to_bf16(w * to_bf16(normed))))
    assert not torch.equal(cpu.rms_norm(x, w, 1e-5, True), to_bf16(w * normed))  # rounded twice, not once
    gu = to_bf16(torch.randn(9, 2 * 96) * 3)
    gate, up = gu[:, :96], gu[:, 96:]
    silu = cpu.kernel().silu_gate(torch.cat([gate, torch.ones_like(up)], 1))  # silu(gate) * 1
    torch.testing.assert_close(silu, torch.nn.functional.silu(gate), rtol=1e-6, atol=1e-7)
    assert torch.equal(bits(cpu.kernel().silu_gate(gu, True)), bits(to_bf16(to_bf16(silu) * up)))
    assert torch.equal(cpu.kernel().silu_gate(gu), silu * up)


def test_gguf_blocks_are_read_byte_for_byte() -> None:
    # GGML's q4_1 block: fp16 d, fp16 m, 16 bytes whose low nibbles are elements 0..15 and high nibbles 16..31
    rng = np.random.default_rng(0)
    values = rng.integers(0, 16, size=(3, 32)).astype(np.uint8)
    d, m = np.float16([0.5, 0.25, 2.0]), np.float16([-1.0, 0.0, 3.0])
    raw = np.concatenate([d.view(np.uint8).reshape(3, 2), m.view(np.uint8).reshape(3, 2),
                          values[:, :16] | (values[:, 16:] << 4)], axis=1)
    q, dd, mm = from_gguf_blocks("Q4_1", raw, 3, 32)
    assert torch.equal(q, torch.from_numpy(values)) and torch.equal(dd[:, 0], torch.from_numpy(d))
    assert torch.equal(mm[:, 0], torch.from_numpy(m))
    q8 = rng.integers(-127, 128, size=(2, 32)).astype(np.int8)
    raw8 = np.concatenate([np.float16([0.1, 0.2]).view(np.uint8).reshape(2, 2), q8.view(np.uint8)], axis=1)
    q, dd, _ = from_gguf_blocks("Q8_0", raw8, 2, 32)
    assert torch.equal(q, torch.from_numpy(q8))


# -- attention -------------------------------------------------------------------------------------------------------

def cache(kv: int, slots: int, d: int, seed: int,
          dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Random keys and values [kv, slots, d]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(kv, slots, d, generator=g).to(dtype), torch.randn(kv, slots, d, generator=g).to(dtype)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """cpu.attend over keys [kv, slots, d] stored in tiles, as the cache stores them."""
    return cpu.attend(q, tile_keys(keys), values, *args, **kwargs)


CHUNK = 256  # attention.h's kChunk: a row's keys in chunks of 256 logical positions, each with its own maximum


def reference_attention(q, keys, values, past: int, visible: torch.Tensor, n: int, bf16: bool | None = None
                        ) -> torch.Tensor:
    """float64 softmax attention of each row over its past keys and the block keys it sees. Over a bf16 cache
    (`bf16`, by default the keys' dtype) the scaled query is in bf16 too, and so are the values' weights: exp(s - m)
    with m the maximum of its chunk, rounded, the chunks' sums (of the weights before rounding) merged."""
    kv, rows, d = q.shape
    bf16 = keys.dtype == torch.bfloat16 if bf16 is None else bf16
    q = q * d**-0.5
    if bf16:
        q = q.to(torch.bfloat16)
    out = torch.empty(kv, rows, d, dtype=torch.float64)
    for r in range(rows):
        i = r % n
        slots = list(range(past)) + [past + j for j in range(n) if visible[i, j]]
        s = (q[:, r].double()[:, None, :] * keys[:, slots].double()).sum(-1)
        v = values[:, slots].double()
        if not bf16:
            out[:, r] = (s.softmax(-1)[:, :, None] * v).sum(1)
            continue
        top = s.max(-1).values
        num, den = torch.zeros(kv, d, dtype=torch.float64), torch.zeros(kv, dtype=torch.float64)
        for c0 in range(0, len(slots), CHUNK):
            m = s[:, c0:c0 + CHUNK].max(-1, keepdim=True).values
            e = (s[:, c0:c0 + CHUNK] - m).exp()
            w = e.float().to(torch.bfloat16).double()
            num += (m - top[:, None]).exp() * (w[:, :, None] * v[:, c0:c0 + CHUNK]).sum(1)
            den += (m[:, 0] - top).exp() * e.sum(-1)
        out[:, r] = num / den[:, None]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("past", [0, 1, 255, 256, 300, 1000])  # 256: a block that starts a tile of keys
def test_attention_matches_softmax_attention(d: int, past: int, dtype: torch.dtype) -> None:
    """Over an fp32 cache: float64's softmax attention to float rounding. Over a bf16 cache: float64's with the
    query and the values' weights in bf16 (reference_attention), where a weight whose fp32 exp and float64's round
    to neighbouring bf16 values moves an output by up to ~1e-4 and the rest agrees to float rounding; without the
    roundings the outputs are off by far more on average."""
    n, kv, group = 5, 3, 3
    keys, values = cache(kv, past + n + 7, d, seed=past + d, dtype=dtype)
    q = torch.randn(kv, group * n, d, generator=torch.Generator().manual_seed(1))
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]]).bool()
    for visible in (tree, torch.ones(n, n).tril().bool()):
        out = attend(q, keys, values, n, past, visible, None, d**-0.5).double()
        reference = reference_attention(q, keys, values, past, visible, n)
        if dtype == torch.float32:
            torch.testing.assert_close(out, reference, rtol=2e-5, atol=2e-5)
            continue
        torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)
        assert (out - reference).abs().mean() < 1e-6
        unrounded = reference_attention(q, keys, values, past, visible, n, bf16=False)
        assert (out - unrounded).abs().mean() > 2e-5
    causal = attend(q, keys, values, n, past, None, None, d**-0.5)
    assert torch.equal(causal, attend(q, keys, values, n, past, torch.ones(n, n).tril().bool(), None, d**-0.5))


def test_a_sliding_window_hides_the_keys_before_it() -> None:
    keys, values = cache(1, 600, 64, seed=3)
    q = torch.randn(1, 1, 64)
    windowed = attend(q, keys, values, 1, 520, None, 100, 64**-0.5)
    # the last 100 keys of the logical sequence (slots 421..520), as a short cache of exactly those keys
    short = attend(q, keys[:, 421:], values[:, 421:], 1, 99, None, None, 64**-0.5)
    torch.testing.assert_close(windowed, short, rtol=1e-6, atol=1e-6)


def branching_trees() -> list:
    """Trees in the layouts TreeBuilder builds (by depth, branching at every level, n-gram chains below)."""
    product = TreeBuilder(root=1)
    product.add_product([[(5, 0.6), (6, 0.3), (7, 0.1)], [(8, 0.5), (9, 0.4)], [(10, 0.9)]])
    chain = TreeBuilder(root=1)
    chain.add_chain([[(5, 0.6), (6, 0.3)], [(8, 0.5), (9, 0.4)], [(10, 0.9), (11, 0.05)]])
    chain.add([6, 12, 13, 14], [0.3, 0.2, 0.1, 0.05], HEADS)
    return [product.build(16), chain.build(16), product.build(4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("past", [3, 250, 254, 700])  # blocks that start in a chunk, straddle one, end one
def test_a_tree_node_attends_as_a_single_step_with_its_ancestors_committed(past: int, dtype: torch.dtype) -> None:
    kv, group, d = 3, 3, 64
    for tree in branching_trees():
        n = len(tree)
        keys, values = cache(kv, past + n + 1, d, seed=past + n, dtype=dtype)
        q = torch.randn(kv, group * n, d, generator=torch.Generator().manual_seed(n))
        together = attend(q, keys, values, n, past, tree.mask(), None, d**-0.5)
        for i in range(n):
            path = [i]
            while tree.parents[path[-1]] >= 0:
                path.append(tree.parents[path[-1]])
            path.reverse()  # root .. node, as vanilla decoding committed them
            k2, v2 = cache(kv, past + len(path), d, seed=0, dtype=dtype)
            k2[:, :past], v2[:, :past] = keys[:, :past], values[:, :past]
            k2[:, past:past + len(path)], v2[:, past:past + len(path)] = keys[:, [past + j for j in path]], \
                values[:, [past + j for j in path]]
            alone = attend(q[:, [g * n + i for g in range(group)]], k2, v2, 1, past + len(path) - 1, None,
                               None, d**-0.5)
            assert torch.equal(alone, together[:, [g * n + i for g in range(group)]]), (n, i)


@pytest.mark.parametrize("past", [0, 300])
def test_a_bf16_cache_without_bf16_products_is_attended_as_its_values_widened(past: int) -> None:
    """A bf16 model's stack reads its bf16 cache with fp32 products: exactly the floats of an fp32 cache holding the
    same values, tree blocks included (widening is exact and the arithmetic is the fp32 path's)."""
    kv, group, d, n = 3, 3, 64, 5
    keys, values = cache(kv, past + n + 9, d, seed=past, dtype=torch.bfloat16)
    q = torch.randn(kv, group * n, d, generator=torch.Generator().manual_seed(4))
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]]).bool()
    wide_keys = keys.float()
    for visible in (tree, None):
        wide = attend(q, wide_keys, values.float(), n, past, visible, None, d**-0.5)
        assert torch.equal(attend(q, keys, values, n, past, visible, None, d**-0.5, bf16_products=False), wide)
        assert not torch.equal(attend(q, keys, values, n, past, visible, None, d**-0.5), wide)


@pytest.mark.parametrize("d", [64, 80])
def test_bf16_pairs_give_the_same_floats_on_vdpbf16ps_and_as_two_fmas(d: int) -> None:
    """The kernels multiply a bf16 cache's pairs on vdpbf16ps or as two fmas, whichever this CPU runs faster: both
    round after each exact product in the same order, so every row count and key count gives the same floats."""
    ext = cpu.kernel()
    before = ext.set_bf16_dots(True)
    try:
        if not ext.bf16_dots():
            pytest.skip("this build has no vdpbf16ps (AVX-512 BF16): its pairs are always two fmas")
        for past, n, kv in ((0, 1, 3), (300, 1, 3), (700, 3, 3), (1000, 8, 3), (513, 16, 2)):
            keys, values = cache(kv, past + n + 3, d, seed=past + n, dtype=torch.bfloat16)
            q = torch.randn(kv, 3 * n, d, generator=torch.Generator().manual_seed(n))
            visible = torch.ones(n, n).tril().bool()
            visible[n // 2:, 1:n // 2] = False  # a branch: the later tokens skip the first ones' descendants
            ext.set_bf16_dots(True)
            dots = attend(q, keys, values, n, past, visible, None, d**-0.5)
            ext.set_bf16_dots(False)
            fmas = attend(q, keys, values, n, past, visible, None, d**-0.5)
            assert torch.equal(dots, fmas), (past, n)
    finally:
        ext.set_bf16_dots(before)


def test_the_decoder_rounds_each_key_and_value_once_as_it_writes_them(tiny_dir: Path) -> None:
    """The first layer's keys and values do not depend on the cache: in a bf16 cache they are PyTorch's rounding of
    those an fp32 cache receives."""
    model = load_model(str(tiny_dir), device="cpu", weights="fp32").model
    ids = torch.randint(512, (70,), generator=torch.Generator().manual_seed(6))
    caches = []
    for kv in (torch.float32, torch.bfloat16):
        model.kv_dtype = kv
        with torch.inference_mode():
            model(ids, torch.arange(70), c := model.new_cache(70))
        caches.append(c)
    wide, narrow = caches
    for name in ("k", "v"):
        assert torch.equal(getattr(narrow, name)[0], getattr(wide, name)[0].to(torch.bfloat16)), name
    assert not torch.equal(narrow.k[0].float(), wide.k[0])


# -- the native decoder ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("native"), vocab_size=512, initializer_range=0.2)


@pytest.mark.parametrize("weights", WEIGHTS)
def test_native_decoder_gives_a_tree_node_the_logits_of_a_single_step(tiny_dir: Path, weights: str) -> None:
    model = load_model(str(tiny_dir), device="cpu", weights=weights).model
    assert model.native and model.bf16_activations == (weights == "bf16")
    prefix = torch.randint(512, (260,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for tree in branching_trees():
            n = len(tree)
            c = model.new_cache(300)
            model(prefix, torch.arange(260), c)
            c.commit()
            tokens = torch.tensor(tree.tokens) % 512
            together, _ = model(tokens, tree.positions(260), c, tree.mask())
            c.rollback()
            for i in range(n):
                path = [i]
                while tree.parents[path[-1]] >= 0:
                    path.append(tree.parents[path[-1]])
                for j in reversed(path[1:]):  # the ancestors, decoded one step each
                    model(tokens[j:j + 1], torch.tensor([260 + tree.depths[j]]), c)
                    c.commit()
                alone, _ = model(tokens[i:i + 1], torch.tensor([260 + tree.depths[i]]), c)
                c.rollback(260)
                assert torch.equal(alone[0], together[i]), (weights, n, i)


@pytest.mark.parametrize("weights", ["fp32", "bf16", "q4"])
def test_native_prefill_gives_the_floats_of_one_token_steps(tiny_dir: Path, weights: str) -> None:
    model = load_model(str(tiny_dir), device="cpu", weights=weights).model
    assert model.bf16_activations == (weights == "bf16")
    ids = torch.randint(512, (300,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        c1 = model.new_cache(301)
        whole, h1 = model(ids, torch.arange(300), c1)
        c2 = model.new_cache(301)
        steps = []
        for i in range(300):
            logits, _ = model(ids[i:i + 1], torch.tensor([i]), c2)
            c2.commit()
            steps.append(logits)
    assert torch.equal(torch.cat(steps), whole)
    assert torch.equal(c1.keys()[:, :, :300], c2.keys()[:, :, :300]) and torch.equal(c1.v[:, :, :300], c2.v[:, :, :300])


@pytest.mark.parametrize("weights", WEIGHTS)
def test_a_forward_in_one_call_gives_the_floats_of_its_parts(tiny_dir: Path, weights: str) -> None:
    """A native forward is one kernel call (the embeddings looked up and the rotary rows found by position inside it,
    the final norm and the lm_head in its threads): its hidden states, logits and cache are exactly those of the
    embedding module, the stack given them, then the model's final norm and lm_head, for every row or a prefill's
    last; a position past the rotary table is refused."""
    model = load_model(str(tiny_dir), device="cpu", weights=weights).model
    ids = torch.randint(512, (40,), generator=torch.Generator().manual_seed(3))
    tree = branching_trees()[0]
    tokens, positions, mask = torch.tensor(tree.tokens) % 512, tree.positions(40), tree.mask()
    with torch.inference_mode():
        runs = []
        for split in (False, True):
            c = model.new_cache(64)
            if split:  # the parts: the embedding module's rows given to the stack, the final norm and lm_head after
                model.bind_stack(with_table=False)  # the stack takes x from the module
                first_h = model.hidden(ids, torch.arange(40), c)
                last = model.logits(first_h[-1:])
                c.commit()
                h = model.hidden(tokens, positions, c, mask)
                logits = model.logits(h)
            else:
                last, first_h = model(ids, torch.arange(40), c, logits_rows=slice(-1, None))
                c.commit()
                logits, h = model(tokens, positions, c, mask)
            runs.append((first_h, last, h, logits, c.k.clone(), c.v.clone()))
        assert all(torch.equal(a, b) for a, b in zip(*runs)), weights
        with pytest.raises(RuntimeError, match="outside the rotary table"):
            model(tokens[:1], torch.tensor([10**6]), model.new_cache(8))


@pytest.mark.parametrize("weights", ["fp32", "bf16", "q4"])
def test_the_native_stack_computes_the_same_floats_on_any_number_of_threads(tiny_dir: Path, weights: str) -> None:
    """The stack's threads share every phase (the per-row glue in pieces of a row, tiles, attention's chunks by
    cost, rows to merge) and meet at barriers; a thread done with its share takes from another's, so which thread
    takes what differs from run to run (and is seen to: tasks were taken), and how many threads there are and who
    took what changes no float: a prefill, a tree block, one-token steps and a two-token block (fewer tokens than
    threads: their rows' norms and gates split by columns) on one, two or three threads give the same logits and the
    same cache."""
    model = load_model(str(tiny_dir), device="cpu", weights=weights).model
    ids = torch.randint(512, (300,), generator=torch.Generator().manual_seed(2))
    tree = branching_trees()[0]
    tokens = torch.tensor(tree.tokens) % 512
    threads = torch.get_num_threads()
    runs = []
    taken = cpu.kernel().tasks_taken()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            with torch.inference_mode():
                c = model.new_cache(300 + len(tree) + 8)
                prefill, _ = model(ids, torch.arange(300), c)
                c.commit()
                block, _ = model(tokens, tree.positions(300), c, tree.mask())
                c.rollback()
                steps = []
                for at in range(300, 303):
                    logits, _ = model(ids[at - 300:at - 299], torch.tensor([at]), c)
                    c.commit()
                    steps.append(logits)
                pair, _ = model(ids[:2], torch.arange(303, 305), c)
                c.commit()
            runs.append((prefill, block, torch.cat(steps), pair, c.k.clone(), c.v.clone()))
    finally:
        torch.set_num_threads(threads)
    assert cpu.kernel().tasks_taken() > taken
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run)), weights


def test_native_fp32_matches_pytorchs_operators(tiny_dir: Path) -> None:
    """The kernels compute PyTorch's model with its KV cache in either format. In bf16 both paths round each key and
    value as it is written; a key whose fp32 sums (taken in another order) fall on either side of a rounding
    boundary lands on a neighbouring bf16 value, so the logits agree to 2e-3 there, where an fp32 cache on one side
    misses by far more."""
    native = load_model(str(tiny_dir), device="cpu", weights="fp32").model
    plain = load_model(str(tiny_dir), device="cpu", native=False).model
    assert native.cache_dtype == torch.bfloat16 and plain.cache_dtype == torch.float32  # the defaults
    ids = torch.randint(512, (40,), generator=torch.Generator().manual_seed(2))

    def logits(model, kv: torch.dtype) -> torch.Tensor:
        model.kv_dtype = kv
        with torch.inference_mode():
            out, _ = model(ids, torch.arange(40), c := model.new_cache(41))
        assert c.k.dtype == c.v.dtype == kv
        return out

    torch.testing.assert_close(logits(native, torch.float32), logits(plain, torch.float32), rtol=1e-4, atol=1e-4)
    reference = logits(plain, torch.bfloat16)
    torch.testing.assert_close(logits(native, torch.bfloat16), reference, rtol=2e-3, atol=2e-3)
    assert not torch.allclose(logits(native, torch.float32), reference, rtol=2e-3, atol=2e-3)


def with_random_norms_and_biases(folder: Path, seed: int) -> Path:
    """The checkpoint with norm weights away from 1 and random biases (a fresh model's are ones and zeros, under
    which rounding w * norm(x) once or twice, or a bias before or after rounding, are the same)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    state = load_file(path)
    g = torch.Generator().manual_seed(seed)
    for name, t in state.items():
        if name.endswith("norm.weight"):
            state[name] = t + 0.3 * torch.randn(t.shape, generator=g)
        elif name.endswith("bias"):
            state[name] = 0.5 * torch.randn(t.shape, generator=g)
    save_file(state, str(path), metadata={"format": "pt"})
    return folder


def fused_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen) -> torch.Tensor:
    """model.attention as CUDA's fused attention (SDPA) computes it in bf16: scores, softmax and the weighted sum
    in fp32 inside, the output rounded to bf16. (The CPU's matmul path rounds the scores and the probabilities to
    bf16 too, which CUDA does not.)"""
    h, n, d = q.shape
    qg = q.reshape(keys.shape[0], -1, d).float()
    keys = key_slots(keys, 0, values.shape[1])  # (a CPU cache holds them in tiles)
    mask = None if seen.bias is None else seen.bias.float()
    out = torch.nn.functional.scaled_dot_product_attention(qg, keys.float(), values.float(), attn_mask=mask)
    return out.to(q.dtype).view(h, n, d)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_native_bf16_computes_the_numerics_of_pytorchs_bf16_model(tmp_path: Path, monkeypatch, arch: str) -> None:
    """--weights bf16 runs the kernels with bf16 activations: the hidden states, the cache's keys and values and the
    logits are bf16 values, and the logits are PyTorch's bf16 model's (model.py's own path in bf16, with attention
    as on CUDA) bit for bit at most positions: the two differ only in the order of the fp32 sums inside a matrix
    product or attention, which now and then rounds a value to its bf16 neighbour, and that spreads down the
    sequence. Every rounding point left out or misplaced (the inner rounding of RMSNorm, of SiLU or of the rotary
    embedding, the attention output, the bias after rounding) leaves under a quarter of the logits and next to no
    position equal; fp32 activations (with the same bf16 weights) none."""
    folder = with_random_norms_and_biases(make_tiny_checkpoint(tmp_path / arch, arch=arch, vocab_size=512,
                                                               initializer_range=0.2), seed=5)
    native = load_model(str(folder), device="cpu", weights="bf16").model
    fp32_acts = load_model(str(folder), device="cpu", weights="bf16", native=False).model
    fp32_acts.to_native("bf16", activations="fp32")
    fp32_acts.kv_dtype = torch.float32  # so its keys and values show what fp32 activations compute
    plain = load_model(str(folder), device="cpu", weights="bf16", native=False).model
    assert native.bf16_activations and not fp32_acts.bf16_activations and plain.dtype == torch.bfloat16
    ids = torch.randint(512, (200,), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(200)
    with torch.inference_mode():
        c = native.new_cache(200)
        logits, hidden = native(ids, positions, c)
        c32 = fp32_acts.new_cache(200)
        logits32, hidden32 = fp32_acts(ids, positions, c32)
        monkeypatch.setattr("core.runtime.model.attention", fused_attention)
        reference, _ = plain(ids, positions, plain.new_cache(200))
    reference = reference.float()
    assert c.k.dtype == c.v.dtype == torch.bfloat16
    for t in (hidden, logits):
        assert torch.equal(to_bf16(t), t)
    for t in (hidden32, c32.k, c32.v, logits32):
        assert not torch.equal(to_bf16(t), t)
    equal = (logits == reference).float().mean().item()
    rows = (logits == reference).all(-1).float().mean().item()
    assert equal > 0.6 and rows > 0.4, (equal, rows)
    assert (logits32 == reference).float().mean().item() < 0.05
    assert (logits32 - reference).abs().mean() > 5 * (logits - reference).abs().mean()


@pytest.mark.slow
def test_real_model_logits_in_a_branching_tree_equal_decoding_alone(smol_engine) -> None:
    """On the default model as shipped (its GGUF's q4_1 and q8_0 blocks, a bf16 cache), every node of a tree — the
    chain and the side branch, whose keys sit at other cache slots than they would in vanilla decoding — gets the
    logits its token gets as a one-token step, bit for bit."""
    model, tok = smol_engine.model, smol_engine.tokenizer
    assert model.native and model.layers[0].wqkv.packed.fmt == "q4_1" and model.lm_head.packed.fmt == "q8_0"
    assert model.new_cache(4).k.dtype == torch.bfloat16
    prompt = torch.tensor(tok.encode("The lighthouse keeper wrote in his log that night"))
    tree = torch.cat([prompt[-1:], torch.tensor(tok.encode(" the storm had")[:3] + tok.encode(" a ship")[:2])])
    parents = [-1, 0, 1, 2, 0, 4]
    block = torch.zeros(6, 6, dtype=torch.bool)
    for i in range(6):
        j = i
        while j >= 0:
            block[i, j], j = True, parents[j]
    depth = block.sum(1) - 1
    n0 = len(prompt) - 1
    with torch.inference_mode():
        cache = model.new_cache(64)
        model(prompt[:-1], torch.arange(n0), cache)
        cache.commit()
        together, _ = model(tree, n0 + depth, cache, block)
        cache.rollback()
        for path in ([0, 1, 2, 3], [0, 4, 5]):
            for step, node in enumerate(path):  # vanilla decoding of this branch, one token per forward
                alone, _ = model(tree[node:node + 1], torch.tensor([n0 + step]), cache)
                cache.commit()
                assert torch.equal(alone[0], together[node]), node
            cache.rollback(n0)


@pytest.mark.parametrize("weights", ["fp32", "bf16", "q4"])
def test_native_engines_run_the_heads_on_the_kernels(tiny_dir: Path, weights: str) -> None:
    """A native engine runs its heads' matrices on the kernels (in the model's format: fp32 or bf16; q8_0 for a
    quantized model, its root head q4_1), and the lm_head rows they score are the model's own rows in its format: a
    head's logit for a token is the lm_head's for that token, bit for bit. A quantized model's root head scores those
    rows in its own q4_1."""
    from core.engine import Engine
    from core.runtime.weights import NativeLinear
    from core.tokenswift.heads import DraftHeads

    loaded = load_model(str(tiny_dir), device="cpu", weights=weights)
    model = loaded.model
    plain_model = load_model(str(tiny_dir), device="cpu", native=False).model
    ids = torch.arange(0, model.cfg.vocab_size, 3)
    heads = DraftHeads.initial(plain_model, vocab=ids, root_width=32)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.05)
    heads.keep_root_ids(ids[::2])
    h = torch.randn(9, model.cfg.hidden_size)
    roots = torch.randint(model.cfg.vocab_size, (9,))
    with torch.inference_mode():
        plain = heads.logits(h, plain_model), heads.root_logits(h, roots, plain_model)
        Engine(loaded, heads)
        assert isinstance(heads.proj[0], NativeLinear) and isinstance(heads.root.up, NativeLinear)
        fmt, root_fmt = {"fp32": ("f32", "f32"), "bf16": ("bf16", "bf16"), "q4": ("q8_0", "q4_1")}[weights]
        assert {layer.packed.fmt for layer in heads.proj} == {fmt}
        root_rows = heads.scorer(model, "root_lm")
        assert {layer.packed.fmt for layer in (heads.root.up, heads.root.down, root_rows)} == {root_fmt}
        if root_fmt != model.lm_head.packed.fmt:  # the lm_head's rows, quantized again
            again = pack(model.lm_head.rows(ids[::2]).packed.dequantize(), root_fmt)
            assert torch.equal(root_rows.packed.data, again.data) and torch.equal(root_rows.packed.d, again.d)
        else:
            assert torch.equal(root_rows(h), model.lm_head(h)[:, ids[::2]])
        logits = heads.logits(h, model)
        states = torch.cat(heads.states(h))
        assert torch.equal(logits.view(-1, len(ids)), model.lm_head(states)[:, ids])
        if weights == "fp32":
            torch.testing.assert_close(logits, plain[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(heads.root_logits(h, roots, model), plain[1], rtol=1e-5, atol=1e-5)


# -- the loader ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [True, False])
def test_every_weights_choice_runs_on_the_kernels_and_kernels_off_on_pytorch(tmp_path: Path, monkeypatch,
                                                                            tied: bool) -> None:
    """On a CPU every --weights choice packs every matrix for the kernels in its format (auto: a safetensors
    checkpoint's fp32); bf16 keeps the embedding table in bf16 too, looked up as fp32 rows, and rounds activations
    to bf16 (only it); the norms are fp32 tensors (of bf16 values for bf16), the KV cache bf16. With
    TOKENSWIFT_KERNELS=off the model runs on PyTorch's operators in the dtype asked for."""
    from core.runtime.model import NativeEmbedding

    folder = make_tiny_checkpoint(tmp_path / "m", vocab_size=512, tie_word_embeddings=tied)
    expected = {"auto": "f32", "fp32": "f32", "bf16": "bf16", "q8": "q8_0", "q4": "q4_1"}
    for weights, fmt in expected.items():
        model = load_model(str(folder), device="cpu", weights=weights).model
        matrices = [getattr(b, name) for b in model.layers for name in ("wqkv", "wo", "w_gate_up", "w_down")]
        assert model.native and {m.packed.fmt for m in [*matrices, model.lm_head]} == {fmt}, weights
        assert model.dtype == torch.float32 and model.new_cache(4).k.dtype == torch.bfloat16
        assert model.bf16_activations == (weights == "bf16")
        assert {m.bf16_out for m in [*matrices, model.lm_head]} == {weights == "bf16"}
        if weights == "bf16":
            assert all(torch.equal(to_bf16(n.weight), n.weight) for b in model.layers for n in (b.attn_norm, b.mlp_norm))
        if tied:  # one table: the lm_head's rows
            assert isinstance(model.embed, NativeEmbedding) and model.embed.table is model.lm_head.packed
        elif weights == "bf16":
            assert isinstance(model.embed, NativeEmbedding) and model.embed.table.fmt == "bf16"
        else:
            assert model.embed.weight.dtype == torch.float32
        assert model.embed(torch.tensor([3, 7])).dtype == torch.float32
    monkeypatch.setenv("TOKENSWIFT_KERNELS", "off")
    cpu.kernel.cache_clear()
    try:
        for weights, dtype in (("auto", torch.float32), ("fp32", torch.float32), ("bf16", torch.bfloat16)):
            model = load_model(str(folder), device="cpu", weights=weights).model
            assert not model.native and model.dtype == dtype and isinstance(model.lm_head, torch.nn.Linear)
    finally:
        monkeypatch.delenv("TOKENSWIFT_KERNELS")
        cpu.kernel.cache_clear()
