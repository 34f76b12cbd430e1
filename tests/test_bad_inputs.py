"""Bad inputs drawn at random, class by class, against every entry point (CPU): each is refused
before any GPU work, with an exception of the type the entry point documents, whose message
names the argument as the entry point's caller spells it and says what is wrong.

The classes (``CLASSES``: one generator each; each (class, entry point) pair draws from its own
seed, printed on failure):

1. an output whose elements overlap each other (``out`` or ``lse`` strides smaller than the
   span they step over, or 0);
2. an output over another tensor's memory (``lse`` over ``out`` or ``q``);
3. a launch past the GPU's grid: a call of two cache formats (so one that merges) with more
   than 65,535 heads;
4. a tensor whose address breaks the alignment the kernels load it with (each tensor argument);
5. a scalar of another type than documented (a bool, a string, a tensor or a list for
   ``sm_scale``, ``precision``, the formats; ``pack``'s byte counts and page size as floats,
   strings, bools or 0);
6. inputs whose refusal's exception and words are pinned: an ``sm_scale`` int past float
   range, sparse tensors, a float16 extra cache, a tensor for an int, integer or empty latents.

Classes 1 to 4 are the decode's (the packers write no output, launch nothing and read any
latent); 5 and 6 apply to the packers too. ``ENTRY_POINTS`` is data: one row per entry point,
with the arguments it takes and how its caller spells them (``names``); an engine adapter is one
more row (its ``call`` passes the case's inputs under its own names, and every refusal must
name them so). A row is run on every case of every class whose argument it takes.

No kernel is compiled or loaded (``loader.get_compiled`` stubbed) and every way to a launch
raises ``LaunchReached`` while a bad call runs (``Trap``); calls are planned for sm_120a on CPU
tensors (``validate_tensors``' ``_target``, for every entry point).
"""

from __future__ import annotations

import dataclasses
import random
import re
from types import MappingProxyType
from typing import Callable, Mapping

import pytest
import torch

from cute_kernels.sparse_mla_decode import cache_writers
from dispatch import InvalidDecodeInput, api, kv_formats, plan_sparse_mla_decode, sparse_mla_decode, validate_call
from dispatch.runtime import loader, plan as plan_module, plan_cache
from dispatch.runtime.decode_inputs import POINTER_ALIGN, DecodeTensors
from dispatch.runtime.plan import DecodePlan
from dispatch.engines.flashinfer_dsv4 import DSV4_KV_CACHE_FORMATS, DSV4_NAMES, trtllm_batch_decode_sparse_mla_dsv4
from dispatch.engines.flashmla import FLASHMLA_NAMES, flash_mla_with_kvcache
from dispatch.tools.sample_inputs import make_cache, make_indices
from tests.dispatch_inputs import NVFP4_CACHE, SM120_TARGET, _misaligned
from tests.tolerances import seed_for

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")

TARGET = SM120_TARGET
DRAWS = 3  # draws of each class per entry point
MODEL1, NVFP4 = "model1_fp8", "model1_nvfp4"
CACHES = {MODEL1: make_cache(4, 64, device="cpu", gen=torch.Generator().manual_seed(43)), NVFP4: NVFP4_CACHE}
TENSORS = DecodeTensors._fields
FORMAT_OPTIONS = ("sm_scale", "precision", "kv_format", "extra_kv_format")
PACK_OPTIONS = ("writer", "block_stride", "row_stride", "fill")


# ---------------------------------------------------------------------- the cases
@dataclasses.dataclass
class Case:
    """One bad call: its arguments by their core names (``inputs``), the argument the refusal
    must name and a regex of the problem it must state; ``planned``: a valid call whose plan
    ``DecodePlan.run`` / ``bind`` is then given ``inputs`` (None: ``inputs``, whose planning is
    the refusal), and ``run_problem`` what they say (None: ``problem``)."""

    what: str
    inputs: dict
    argument: str
    problem: str
    planned: dict | None = None
    run_problem: str | None = None


LAYOUT_CHANGED = r"the plan was built for"  # what run / bind say of a tensor laid out otherwise


def _valid_call(rng: random.Random, gen: torch.Generator, *, heads=(1, 2, 16, 20, 64), tokens=(1, 2, 3, 5),
                formats=None) -> dict:
    """A valid call with every optional input: one or two cache formats (DeepSeek-V4's
    records), random T, H, topk; out and lse given, contiguous."""
    T, H = rng.choice(tokens), rng.choice(heads)
    main, extra = formats or rng.choice([(MODEL1, MODEL1), (MODEL1, NVFP4), (NVFP4, MODEL1)])
    topk, extra_topk = rng.choice([1, 40, 128]), rng.choice([8, 64])
    return dict(q=torch.randn(T, H, 512, generator=gen).bfloat16(), kv_cache=CACHES[main],
                indices=make_indices(T, topk, 256, device="cpu", gen=gen),
                topk_length=torch.randint(0, topk + 1, (T,), generator=gen, dtype=torch.int32),
                attn_sink=torch.randn(H, generator=gen), extra_kv_cache=CACHES[extra],
                extra_indices=make_indices(T, extra_topk, 256, device="cpu", gen=gen),
                extra_topk_length=torch.randint(0, extra_topk + 1, (T,), generator=gen, dtype=torch.int32),
                out=torch.empty(T, H, 512, dtype=torch.bfloat16), lse=torch.empty(T, H),
                sm_scale=rng.choice([None, 0.05, 1]), kv_format=main, extra_kv_format=extra)


def _with(base: dict, **changed) -> dict:
    return {**base, **changed}


def _strided(shape, strides, dtype) -> torch.Tensor:
    """A view of ``shape`` and ``strides`` over a fresh buffer just large enough."""
    span = sum((n - 1) * s for n, s in zip(shape, strides)) + 1
    return torch.as_strided(torch.zeros(span, dtype=dtype), shape, strides)


def _sparse(t: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """``t`` in a sparse layout: COO, or CSR for a 2-D tensor half the time."""
    return t.to_sparse_csr() if t.dim() == 2 and rng.random() < 0.5 else t.to_sparse()


def _overlapping_outputs(rng, gen) -> list[Case]:
    base = _valid_call(rng, gen, heads=(2, 16, 20, 64), tokens=(2, 3, 5))
    T, H = base["q"].shape[:2]
    head_stride = 4 * rng.randrange(1, 128)  # rows of a token closer than their 512 elements
    token_stride = 4 * rng.randrange(1, H * 128)  # tokens closer than their H rows
    lse_token_stride = rng.randrange(1, H)
    outs = {
        "heads": _strided((T, H, 512), ((H - 1) * head_stride + 512, head_stride, 1), torch.bfloat16),
        "tokens": _strided((T, H, 512), (token_stride, 512, 1), torch.bfloat16),
        "stride 0": torch.empty(1, H, 512, dtype=torch.bfloat16).expand(T, H, 512),
    }
    cases = [Case(f"out whose {k} overlap", _with(base, out=out), "out", r"overlaps itself|has a stride of 0", base,
                  LAYOUT_CHANGED) for k, out in outs.items()]
    lses = {"tokens": _strided((T, H), (lse_token_stride, 1), torch.float32),
            "stride 0": torch.empty(T, 1).expand(T, H)}
    return cases + [Case(f"lse whose {k} overlap", _with(base, lse=lse), "lse", r"overlaps itself|has a stride of 0",
                         base, LAYOUT_CHANGED) for k, lse in lses.items()]


def _aliased_outputs(rng, gen) -> list[Case]:
    """lse laid over out's or q's bytes: the same layouts as a valid call, so plan.run's
    per-call check refuses it too."""
    base = _valid_call(rng, gen)
    T, H = base["q"].shape[:2]
    cases = []
    for other in ("out", "q"):
        buffer = torch.empty(T * H * 512, dtype=torch.bfloat16)
        start = 4 * rng.randrange(0, T * H * 255 + 1)  # an aligned offset inside the 1024 bytes a row of q or out has
        lse = buffer.view(torch.uint8)[start:start + T * H * 4].view(torch.float32).view(T, H)
        inputs = _with(base, lse=lse, **{other: buffer.view(T, H, 512)})
        cases.append(Case(f"lse over {other}'s bytes", inputs, "lse", rf"overlaps .*in memory", base))
    return cases


def _heads_past_the_grid(rng, gen) -> list[Case]:
    """A call of two formats (one partial kernel per list, then the merge, whose grid's y is
    the heads) with more heads than a grid's y holds."""
    H = 65536 + rng.randrange(0, 64)
    base = _valid_call(rng, gen, heads=(1,), tokens=(1,), formats=rng.choice([(MODEL1, NVFP4), (NVFP4, MODEL1)]))
    inputs = _with(base, q=torch.empty(1, H, 512, dtype=torch.bfloat16), attn_sink=torch.zeros(H),
                   out=torch.empty(1, H, 512, dtype=torch.bfloat16), lse=torch.empty(1, H))
    return [Case(f"{H} heads in a call of two formats", inputs, "q", r"past CUDA's limit of 65,535 on a grid's y")]


def _misaligned_tensors(rng, gen) -> list[Case]:
    base = _valid_call(rng, gen)
    cases = []
    for name in TENSORS:
        align = POINTER_ALIGN[name]
        t = base[name]
        offset = rng.randrange(1, align)
        if name in ("q", "out") and rng.random() < 0.5:
            offset = t.element_size() * rng.randrange(1, align // t.element_size())  # element aligned
        cases.append(Case(f"{name} {offset} bytes past an aligned address", _with(base, **{name: _misaligned(t, offset)}),
                          name, r"\d+-byte aligned", base))
    return cases


def _scalars_of_another_type(rng, gen) -> list[Case]:
    base = _valid_call(rng, gen)
    scales = [True, False, "0.05", torch.tensor(0.05), [0.05], 0.05j]
    texts = [True, 1, ["f16"], 0.5]
    cases = [Case(f"sm_scale={s!r}", _with(base, sm_scale=s), "sm_scale", r"must be a real Python number", base)
             for s in rng.sample(scales, 3)]
    for name, problem in (("precision", r"precision must be one of"), ("kv_format", r"kv_format must be one of"),
                          ("extra_kv_format", r"extra_kv_format must be one of")):
        value = rng.choice(texts)
        cases.append(Case(f"{name}={value!r}", _with(base, **{name: value}), name, problem, base))
    return cases


def _other_words(rng, gen) -> list[Case]:
    base = _valid_call(rng, gen)
    cases = [Case("sm_scale past float range", _with(base, sm_scale=rng.choice([10**400, -(2**1100)])), "sm_scale",
                  r"must be a real Python number", base)]
    for name in TENSORS:
        cases.append(Case(f"sparse {name}", _with(base, **{name: _sparse(base[name], rng)}), name, r"sparse", base,
                          r"sparse"))
    as_f16 = base["extra_kv_cache"].view(torch.float16)  # its bytes as float16: rows half as many elements wide
    return cases + [Case("float16 extra cache", _with(base, extra_kv_cache=as_f16), "extra_kv_cache",
                         r"must be uint8 or float8_e4m3fn, got float16", base, LAYOUT_CHANGED)]


# the packers' cases: a latent [num_blocks, P, d_qk] and pack's arguments
def _pack_call(rng, gen) -> dict:
    kv_format = rng.choice(["glm_nope_fp8", "v41_fp8_inline", "v32_fp8"])  # formats with a row stride
    d = kv_formats.FORMATS[kv_format].d_qk
    page = rng.choice([1, 4, 16])
    return dict(latent=torch.randn(rng.choice([1, 3]), page, d, generator=gen), kv_format=kv_format,
                page_block_size=page)


def _pack_scalars_of_another_type(rng, gen) -> list[Case]:
    base = _pack_call(rng, gen)
    page = base["page_block_size"]
    stride = kv_formats.FORMATS[base["kv_format"]].row_pitches[0]
    bad = {"block_stride": [float(page * stride), str(page * stride), True, 0, -16],
           "row_stride": [float(stride), str(stride), True, 0], "fill": [True, 1.0, "0"],
           "page_block_size": [float(page), True, str(page)], "writer": [1, ["vllm"], ""]}
    return [Case(f"{name}={value!r}", _with(base, **{name: value}), name, r"must be")
            for name, values in bad.items() for value in rng.sample(values, 2)]


def _pack_other_words(rng, gen) -> list[Case]:
    base = _pack_call(rng, gen)
    latent = base["latent"]
    latents = {"integer latent": (latent.to(torch.int32), r"floating-point"),
               "empty latent": (latent[:0], r"holds no token"),
               "sparse latent": (latent.to_sparse(), r"sparse"),
               "latent as a list": (latent.tolist(), r"must be a floating-point torch.Tensor")}
    cases = [Case(what, _with(base, latent=t), "latent", problem) for what, (t, problem) in latents.items()]
    for name in ("page_block_size", "block_stride", "row_stride"):
        value = torch.tensor(base["page_block_size"] * 656)
        cases.append(Case(f"{name} as a tensor", _with(base, **{name: value}), name, r"must be"))
    return cases


@dataclasses.dataclass(frozen=True)
class BadInputClass:
    """A class of bad inputs: its generators of the decode's and the packers' cases ((rng, gen)
    -> cases; None where the class has none) and the arguments their cases make bad."""

    name: str
    arguments: frozenset
    decode: Callable | None
    pack: Callable | None = None


CLASSES = [
    BadInputClass("1 outputs overlapping themselves", frozenset({"out", "lse"}), _overlapping_outputs),
    BadInputClass("2 an output over another tensor", frozenset({"lse"}), _aliased_outputs),
    BadInputClass("3 heads past the launch grid", frozenset({"q"}), _heads_past_the_grid),
    BadInputClass("4 misaligned tensors", frozenset(DecodeTensors._fields), _misaligned_tensors),
    BadInputClass("5 scalars of another type", frozenset(FORMAT_OPTIONS + PACK_OPTIONS + ("page_block_size",)),
                  _scalars_of_another_type, _pack_scalars_of_another_type),
    BadInputClass("6 the wrong kind or words",
                  frozenset(DecodeTensors._fields + ("sm_scale", "latent", "page_block_size", "block_stride",
                                                     "row_stride")), _other_words, _pack_other_words),
]


# ---------------------------------------------------------------------- the entry points
class LaunchReached(Exception):
    """A bad call got as far as loading a kernel or launching one."""


class Trap:
    """The kernels stubbed: nothing is compiled or loaded, and while ``armed`` any step towards
    a launch (a kernel loaded, arguments bound, a launch) raises ``LaunchReached``; unarmed
    (a valid call planned or launched first), those steps do nothing."""

    def __init__(self):
        self.armed = False

    def reach(self, what: str):
        if self.armed:
            raise LaunchReached(f"a bad input reached {what}")


@pytest.fixture
def trap(monkeypatch):
    trap = Trap()
    validate_tensors = api.validate_tensors
    monkeypatch.setattr(api, "validate_tensors", lambda given, **kw: validate_tensors(given, **{**kw, "_target": TARGET}))
    monkeypatch.setattr(loader, "get_compiled", lambda variant: trap.reach(f"a kernel load ({variant.name})"))
    monkeypatch.setattr(DecodePlan, "_make_kernels", lambda self, values: trap.reach("the kernels' arguments") or [])
    monkeypatch.setattr(DecodePlan, "_bind_and_launch", lambda self, values: trap.reach("a launch"))
    monkeypatch.setattr(DecodePlan, "new_scratch", lambda self: torch.empty(self.scratch_bytes, dtype=torch.uint8))
    monkeypatch.setattr(plan_module, "BoundDecode", lambda *args: trap.reach("a bound launch"))
    monkeypatch.setattr(plan_cache, "_capturing", lambda: False)
    monkeypatch.setattr(plan_cache, "raw_stream", lambda index: 7)
    api.clear_plan_cache()
    yield trap
    api.clear_plan_cache()


def _armed(call):
    """An entry point's call of a case, the trap armed first."""
    def run(case: Case, trap: Trap):
        trap.armed = True
        return call(case.inputs)
    return run


def _decode(inputs: dict):
    return sparse_mla_decode(**inputs)


def _after_a_valid_call(case: Case, trap: Trap):
    """The valid call of the same layouts first (planned, cached, its launch stubbed), then the
    bad one: the cached layout's call must decline it and the full validation refuse it."""
    if case.planned is not None:
        sparse_mla_decode(**case.planned)
    trap.armed = True
    return sparse_mla_decode(**case.inputs)


# how an engine's caller spells the decode's arguments (FlashInfer's DeepSeek-V4 call's names)
CALLER_NAMES = MappingProxyType(dict(
    q="query", kv_cache="swa_kv_cache", indices="sparse_indices", topk_length="swa_topk_lens", attn_sink="sinks",
    out="output", lse="softmax_lse", extra_kv_cache="compressed_kv_cache", extra_indices="extra_sparse_indices",
    extra_topk_length="extra_sparse_topk_lens", sm_scale="bmm1_scale"))


def _one_shot_with_caller_names(inputs: dict):
    tensors = DecodeTensors(**{k: v for k, v in inputs.items() if k in TENSORS})
    return api.one_shot_decode(tensors, sm_scale=inputs["sm_scale"], lse_convention="natural",
                               precision=inputs.get("precision"), kv_format=inputs["kv_format"],
                               extra_kv_format=inputs["extra_kv_format"], names=CALLER_NAMES)


def _plan(inputs: dict):
    return plan_sparse_mla_decode(**{k: v for k, v in inputs.items() if k != "sm_scale"})


def _planned_then(method: str):
    """plan.run / plan.bind: a plan of the case's valid call (or of its own, which refuses),
    then the method on the case's inputs."""
    def run(case: Case, trap: Trap):
        trap.armed = case.planned is None  # a valid call's plan is built unarmed
        plan = _plan(case.planned or case.inputs)
        trap.armed = True
        inputs = case.inputs
        return getattr(plan, method)(inputs["q"], inputs["kv_cache"], inputs["indices"], scratch=plan.new_scratch(),
                                     **{k: v for k, v in inputs.items() if k not in ("q", "kv_cache", "indices")
                                        and k not in FORMAT_OPTIONS[1:]})
    return run


def _torch_op(inputs: dict):
    tensors = {k: v for k, v in inputs.items() if k in TENSORS and k not in ("q", "kv_cache", "indices", "out", "lse")}
    return torch.ops.dsv4_mla.sparse_mla_decode(inputs["q"], inputs["kv_cache"], inputs["indices"],
                                                inputs["sm_scale"] if inputs["sm_scale"] is not None else 0.05,
                                                **tensors, precision=inputs.get("precision"),
                                                kv_format=inputs["kv_format"], extra_kv_format=inputs["extra_kv_format"])


def _torch_schema_refuses(case: Case) -> bool:
    """Whether torch's own argument parser refuses the case's value before the op runs (the op's
    schema: a Scalar sm_scale, int64 at most; str? formats and precision)."""
    value = case.inputs.get(case.argument)
    if case.argument == "sm_scale":
        return not isinstance(value, (int, float, complex)) or (isinstance(value, int) and abs(value) >= 2**63)
    return case.argument in FORMAT_OPTIONS and not isinstance(value, str)


def _pack(inputs: dict):
    return kv_formats.pack(inputs["latent"], inputs["kv_format"], inputs["page_block_size"],
                           **{k: v for k, v in inputs.items() if k in PACK_OPTIONS})


def _pack_latent(inputs: dict):
    return cache_writers.pack_latent(inputs["latent"], inputs["kv_format"],
                                     **{k: v for k, v in inputs.items() if k in PACK_OPTIONS})


DECODE_ARGUMENTS = frozenset(TENSORS + FORMAT_OPTIONS)
# FlashInfer's kv_cache_format for a (main, extra) pair of formats, where it names one
_DSV4_FORMAT_OF = {pair: name for name, pair in DSV4_KV_CACHE_FORMATS.items()}


def _flashinfer_dsv4(inputs: dict):
    """vLLM's SM120 call of FlashInfer's DeepSeek-V4 decode, on the case's inputs."""
    extra = inputs["extra_kv_format"] if inputs.get("extra_kv_cache") is not None else inputs["kv_format"]
    return trtllm_batch_decode_sparse_mla_dsv4(
        inputs["q"], inputs["kv_cache"], None, sparse_indices=inputs["indices"],
        compressed_kv_cache=inputs.get("extra_kv_cache"), out=inputs.get("out"),
        bmm1_scale=inputs["sm_scale"] if inputs["sm_scale"] is not None else 0.05, sinks=inputs.get("attn_sink"),
        kv_layout="NHD", swa_topk_lens=inputs.get("topk_length"), extra_sparse_indices=inputs.get("extra_indices"),
        extra_sparse_topk_lens=inputs.get("extra_topk_length"),
        kv_cache_format=_DSV4_FORMAT_OF.get((inputs["kv_format"], extra), inputs["kv_format"]))


def _flashinfer_expresses(case: Case) -> bool:
    """FlashInfer's kv_cache_format names one format for both caches (or V4.1's pairs): a case
    of two DeepSeek-V4 formats is no call of it."""
    inputs = case.inputs
    extra = inputs["extra_kv_format"] if inputs.get("extra_kv_cache") is not None else inputs["kv_format"]
    return isinstance(inputs["kv_format"], str) and (inputs["kv_format"], extra) in _DSV4_FORMAT_OF


def _flashmla(inputs: dict):
    """vLLM's Hopper call of FlashMLA's decode, on the case's inputs (one query per batch entry)."""
    q, out = inputs["q"], inputs.get("out")
    return flash_mla_with_kvcache(
        q.unsqueeze(1), inputs["kv_cache"], None, None, 512, softmax_scale=inputs["sm_scale"], is_fp8_kvcache=True,
        indices=inputs["indices"], attn_sink=inputs.get("attn_sink"), extra_k_cache=inputs.get("extra_kv_cache"),
        extra_indices_in_kvcache=inputs.get("extra_indices"), topk_length=inputs.get("topk_length"),
        extra_topk_length=inputs.get("extra_topk_length"), out=None if out is None else out.unsqueeze(1),
        kv_format=inputs["kv_format"], extra_kv_format=inputs["extra_kv_format"])


def _flashmla_expresses(case: Case) -> bool:
    """FlashMLA's query and output are [batch, seq_q, heads, dim]: a sparse one is no call of it."""
    return all(t is None or t.layout == torch.strided for t in (case.inputs["q"], case.inputs.get("out")))


@dataclasses.dataclass(frozen=True)
class EntryPoint:
    """A row of the table: ``call(case, trap)`` makes the case's call (arming the trap before the
    bad call); ``kind`` "decode" or "pack" (whose cases it takes); ``takes``: the core
    arguments it takes; ``names``: how its caller spells them (core name -> its own);
    ``errors``: the exceptions it documents; ``runs_a_plan``: it is given tensors laid out for
    another plan (``Case.run_problem``); ``torch_schema``: torch's parser sees the arguments
    first (its RuntimeError or OverflowError for what ``_torch_schema_refuses``)."""

    name: str
    call: Callable[[Case, Trap], object]
    kind: str
    takes: frozenset
    names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    errors: tuple = (InvalidDecodeInput,)
    runs_a_plan: bool = False
    torch_schema: bool = False
    expresses: Callable[[Case], bool] = lambda case: True  # whether the case is a call of this entry point
    cannot: Mapping[str, str] = dataclasses.field(default_factory=dict)  # class name -> why none of its cases is
    classes: str = ""  # the classes it meets, where not every one (a decode without lse: not class 2)


ENTRY_POINTS = [
    EntryPoint("sparse_mla_decode", _armed(_decode), "decode", DECODE_ARGUMENTS),
    EntryPoint("sparse_mla_decode after a valid call of the layouts", _after_a_valid_call, "decode",
               DECODE_ARGUMENTS),
    EntryPoint("one_shot_decode with caller names", _armed(_one_shot_with_caller_names), "decode", DECODE_ARGUMENTS,
               names=CALLER_NAMES),
    EntryPoint("plan_sparse_mla_decode", _armed(_plan), "decode", DECODE_ARGUMENTS - {"sm_scale"}),
    EntryPoint("DecodePlan.run", _planned_then("run"), "decode", frozenset(TENSORS + ("sm_scale",)),
               errors=(ValueError,), runs_a_plan=True),
    EntryPoint("DecodePlan.bind", _planned_then("bind"), "decode", frozenset(TENSORS + ("sm_scale",)),
               errors=(ValueError,), runs_a_plan=True),
    EntryPoint("validate_call", _armed(lambda inputs: validate_call(**inputs)), "decode", DECODE_ARGUMENTS),
    EntryPoint("torch.ops.dsv4_mla.sparse_mla_decode", _armed(_torch_op), "decode",
               DECODE_ARGUMENTS - {"out", "lse"}, torch_schema=True),
    EntryPoint("FlashInfer's trtllm_batch_decode_sparse_mla_dsv4 (vLLM, SM120)", _armed(_flashinfer_dsv4), "decode",
               frozenset(TENSORS + ("sm_scale",)) - {"lse"}, names=DSV4_NAMES, expresses=_flashinfer_expresses,
               cannot={"3 heads past the launch grid": "a call of one format (FlashInfer's kv_cache_format) with that "
                                                      "many heads runs one split: nothing to merge"},
               classes="13456"),  # it takes no lse (FlashInfer's call returns a new one)
    EntryPoint("FlashMLA's flash_mla_with_kvcache (vLLM and SGLang, Hopper)", _armed(_flashmla), "decode",
               DECODE_ARGUMENTS - {"lse", "precision"}, names=FLASHMLA_NAMES, expresses=_flashmla_expresses,
               classes="13456"),  # it takes no lse (FlashMLA's call returns a new one)
    EntryPoint("kv_formats.pack", _armed(_pack), "pack",
               frozenset(("latent", "page_block_size") + PACK_OPTIONS), errors=(ValueError,)),
    EntryPoint("cache_writers.pack_latent", _armed(_pack_latent), "pack", frozenset(("latent",) + PACK_OPTIONS),
               errors=(ValueError,)),
]

# every class at every entry point that takes an argument it makes bad (the torch op allocates
# its outputs: classes 1 and 2 are not its; the packers write no output and launch nothing)
PAIRS = [pytest.param(klass, entry, id=f"{klass.name}-{entry.name}") for klass in CLASSES for entry in ENTRY_POINTS
         if getattr(klass, entry.kind) is not None and klass.arguments & entry.takes]


def _word(name: str) -> str:
    """A regex of ``name`` as a whole argument name (not inside another: ``indices`` is not in
    ``sparse_indices``)."""
    return rf"(?<![\w.]){re.escape(name)}(?!\w)"


@pytest.mark.parametrize("klass,entry", PAIRS)
def test_a_bad_input_is_refused_before_any_gpu_work(klass, entry, trap):
    seed = seed_for(f"bad inputs {klass.name} {entry.name}")
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    ran, draws = 0, 0
    for draw in range(10 * DRAWS):  # DRAWS draws with a case this entry point expresses (most draw one at once)
        if draws == DRAWS:
            break
        cases = [c for c in getattr(klass, entry.kind)(rng, gen) if c.argument in entry.takes and entry.expresses(c)]
        draws += bool(cases)
        for case in cases:
            where = f"[seed {seed}, draw {draw}] {entry.name}: {case.what}"
            trap.armed = False
            api.clear_plan_cache()
            torch_refuses = entry.torch_schema and _torch_schema_refuses(case)
            errors = (RuntimeError, OverflowError) if torch_refuses else entry.errors
            try:
                entry.call(case, trap)
            except errors as err:
                refusal = err
            except LaunchReached as err:
                pytest.fail(f"{where}: {err}")
            else:
                pytest.fail(f"{where}: accepted")
            ran += 1
            text = str(refusal)
            if torch_refuses and not isinstance(refusal, RuntimeError):
                continue  # torch's OverflowError for an int past int64 names no argument
            name = entry.names.get(case.argument, case.argument)
            assert re.search(_word(name), text), f"{where}: the refusal does not name {name!r}: {text}"
            if name != case.argument:
                assert not re.search(_word(case.argument), text), f"{where}: the core name in: {text}"
            problem = case.run_problem if entry.runs_a_plan and case.run_problem else case.problem
            if not torch_refuses:
                assert re.search(problem, text), f"{where}: the refusal does not say {problem!r}: {text}"
    assert ran or klass.name in entry.cannot, f"{entry.name} takes no argument of class {klass.name}"


def test_every_class_reaches_every_entry_point_it_applies_to():
    """Each class's cases make bad exactly the arguments it declares; every entry point meets
    every class it takes an argument of: the decode's entry points all six classes, but the
    torch op (no outputs given) classes 3 to 6; the packers classes 5 and 6."""
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    for klass in CLASSES:
        drawn = {c.argument for kind in ("decode", "pack") if getattr(klass, kind)
                 for c in getattr(klass, kind)(rng, gen)}
        assert drawn == klass.arguments, klass.name
    met = {entry.name: {p.values[0].name[0] for p in PAIRS if p.values[1] is entry} for entry in ENTRY_POINTS}
    for entry in ENTRY_POINTS:
        expected = entry.classes or (("3456" if entry.torch_schema else "123456") if entry.kind == "decode" else "56")
        assert met[entry.name] == set(expected), entry.name


def test_a_refusal_names_the_argument_as_the_caller_spells_it():
    """``one_shot_decode(..., names=)`` (what the adapters call): every refusal names the
    argument through the mapping; a mapping of anything but the decode's arguments is the
    adapter's mistake (TypeError)."""
    base = _valid_call(random.Random(1), torch.Generator().manual_seed(1), formats=(MODEL1, MODEL1))
    bad = _with(base, indices=base["indices"].long(), attn_sink=base["attn_sink"][:1])
    with pytest.raises(InvalidDecodeInput, match=r": sparse_indices must be int32, got int64$"):
        _one_shot_with_caller_names(bad)
    with pytest.raises(InvalidDecodeInput, match=r": indices must be int32, got int64$"):
        sparse_mla_decode(**bad)
    with pytest.raises(InvalidDecodeInput, match=r"bmm1_scale must be a real Python number .*, got True$"):
        _one_shot_with_caller_names(_with(base, sm_scale=True))
    for names in ({"queries": "q"}, {"q": 1}):
        with pytest.raises(TypeError, match="names must map arguments of the decode"):
            api.validate_call(**base, names=names, _target=TARGET)
