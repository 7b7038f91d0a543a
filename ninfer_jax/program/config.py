"""The Program's static configuration (frozen, validated; a jit static argument)."""

from __future__ import annotations

import dataclasses

from ninfer_jax.errors import ConfigError

ATTENTION_IMPLS = ("reference", "pallas")
GDN_IMPLS = ("reference", "pallas", "pallas_verify")
DTYPES = ("float32", "bfloat16")
KV_DTYPES = ("auto", "int8")  # "auto": K/V pages in `dtype`; "int8": INT8 pages with scales
AUTO = "auto"  # dtype / attention_impl / gdn_impl: `platform_defaults` for the running backend
LAYER_LOOPS = ("auto", "unrolled", "scan")
SPECULATIVE = ("off", "mtp", "dflash")
MAX_SPECULATIVE_TOKENS = {"mtp": 5, "dflash": 15}  # K per backend
DRAFT_HEADS = ("full", "selector")  # a DFlash drafter's proposal heads
DRAFT_POLICIES = ("adaptive", "fixed")
MOE_SHARDINGS = ("intermediate", "expert")  # tensor_parallel's split of MoE experts
MIN_VISION_BUCKET = 64  # the smallest padded patch count the vision encoder compiles for


def platform_defaults(platform: str, dtype: str | None = None) -> dict[str, str]:
    """The one place that decides the defaults per platform (jax's backend name: "cpu",
    "gpu", "tpu"). GPU: bf16 weights, activations and K/V (matmuls accumulate in fp32, GDN state
    stays fp32), the Pallas (Triton) attention kernels, and the GDN kernel for verify windows
    only. Measured on an H200 (`results/gpu_check_h200_2026-12-04.md`, 27B dims): the GDN
    kernels, IEEE fp32 throughout, took 6.0 ms for a 512-token chunk against 0.72 ms for the
    jnp chunked form and 0.149 against 0.104 ms for decode at B = 8, but 0.240 against 0.401 ms
    for a 4-token verify window; with `dtype` float32 the attention kernels (IEEE fp32 dots
    on CUDA cores) were 17x (decode) and 12x (512-token prefill) slower than the jnp
    reference, so `dtype` float32 takes the reference. (XLA's jnp dots on fp32 operands use
    TF32 on that GPU: 2-4e-4 off the IEEE kernels at those dims.) CPU: fp32, since XLA:CPU has
    no bf16 dot (bf16 operands are upcast every step), and the jnp references. TPU: bf16 with
    the jnp references (the kernels are Triton-only). The layer loop: unrolled on CPU and GPU,
    a scan on TPU (not measured there). A scan indexes each layer's weights in a stacked buffer,
    and XLA copies such a slice before the matmul reads it: XLA:CPU always, and XLA:GPU for
    most of the 27B's weights (its sm_90 decode step copied 45 of the 47.7 GiB it reads, and
    the 35B-A3B's 1.25 of 5.5 GiB: `scripts/cuda_compile_check.py`), so a step moves them two
    or three times. Unrolled, each layer's weights are arguments of their own: no copy, for
    2-3x the compile time (27B decode 22.5 s against 7.0 s for sm_90 on 2 CPU cores)."""
    if platform == "cpu":
        return {"dtype": "float32", "attention_impl": "reference", "gdn_impl": "reference",
                "layer_loop": "unrolled"}
    if platform == "gpu":
        return {"dtype": "bfloat16",
                "attention_impl": "reference" if dtype == "float32" else "pallas",
                "gdn_impl": "pallas_verify", "layer_loop": "unrolled"}
    return {"dtype": "bfloat16", "attention_impl": "reference", "gdn_impl": "reference",
            "layer_loop": "scan"}


def resolve_layer_loop(layer_loop: str) -> str:
    """`layer_loop`, with "auto" replaced by the running backend's default."""
    if layer_loop != AUTO:
        return layer_loop
    import jax

    return platform_defaults(jax.default_backend())["layer_loop"]


def resolve_dtype(dtype: str) -> str:
    """`dtype`, with "auto" replaced by the running backend's default."""
    if dtype != AUTO:
        return dtype
    import jax

    return platform_defaults(jax.default_backend())["dtype"]


def engine_pools(pcfg: ProgramConfig, prefix_reuse: bool = True) -> dict[str, int]:
    """The pool sizes Engine.open gives a Program it is not told otherwise: two sequences'
    pages a lane and, with prefix reuse, four checkpoint slots a lane (`ninfer plan` and the
    GPU compile check size theirs the same way)."""
    return {"num_pages": 2 * pcfg.max_concurrency * pcfg.max_pages_per_seq,
            "num_checkpoint_slots": 4 * pcfg.max_concurrency if prefix_reuse else 0}


@dataclasses.dataclass(frozen=True)
class ProgramConfig:
    """Pool sizes and step shapes. Every field is static: changing one means new executables."""

    max_concurrency: int = 8  # decode executables for every B in 1..max_concurrency
    page_size: int = 16  # KV positions per page
    num_pages: int = 256  # KV pages in the pool (shared by all attention layers' stacks)
    max_seq_len: int = 2048  # prompt + generated tokens of one sequence
    prefill_chunk: int = 64  # tokens per staged-prefill step (the last chunk padded, masked)
    # "reference" (jnp) or "pallas"; "auto": `platform_defaults` for the running backend,
    # resolved when the config is made (the field then holds the choice)
    attention_impl: str = AUTO
    dtype: str = AUTO  # weights, activations and KV pages; "auto" as attention_impl
    # K/V pages: "auto", in `dtype`; "int8", INT8 with a float32 scale per token and kv head
    # (`pallas_kernels.paged_attention.quant`): about half the bytes of bf16 pages. GDN state
    # (fp32 recurrent, `dtype` conv) and a DFlash drafter's context window are not affected.
    kv_dtype: str = AUTO
    # The GDN layers' recurrence: "reference" (jnp), "pallas" (the kernels for chunked
    # prefill, token-by-token decode and verify) or "pallas_verify" (the kernel for verify
    # windows, the jnp forms otherwise: the GPU default); "auto" as attention_impl
    gdn_impl: str = AUTO
    num_checkpoint_slots: int = 0  # GDN state images of prefix checkpoints (0 = no reuse)
    # "unrolled": one weight array per layer, a Python loop (no layer's weights copied before
    # its matmul, slower compiles); "scan": lax.scan over stacked weights; "auto":
    # `platform_defaults` (unrolled on CPU and GPU, scan on TPU).
    layer_loop: str = "auto"
    background_compile: bool = True  # compile all but the prefill step on a background thread
    # "mtp": every decode round drafts `num_speculative_tokens` tokens with the model's MTP
    # head and verifies them in one step (needs MTP weights); "dflash": a DFlash block drafter
    # proposes them in one parallel pass (needs a drafter); "off": one token per round.
    speculative: str = "off"
    num_speculative_tokens: int = 0  # K: 1..5 with "mtp", 1..15 with "dflash", 0 with "off"
    # What turns a DFlash block into drafts: "full", the lm-head proposal, every position in
    # parallel (each under the row's transform); "selector", the drafter's candidate selector
    # over the proposal's top-k, one position after another. On the embedded model "full"
    # decodes faster at every K (docs/speculative.md, "DFlash").
    draft_head: str = "full"
    # "adaptive": decode rounds are compiled for several draft counts (`round_drafts`, 0 and
    # num_speculative_tokens among them) and the Engine picks one per round from the step
    # times and acceptance it measures (`engine/spec_policy.py`); "fixed": every round drafts
    # num_speculative_tokens.
    draft_policy: str = "adaptive"
    # The most patches of one prompt's images and videos together (a model with a vision
    # tower): the vision encoder compiles for every power of two from 64 up to it (a prompt's
    # patches run in the smallest that holds them, so padding wastes under half); 0: no
    # vision executables, prompts with media are refused.
    max_vision_patches: int = 4096
    # Devices the model is split over (`program.sharding`: heads, MLP rows, vocabulary; the
    # K/V pages and GDN state by head); 1: the default device alone.
    tensor_parallel: int = 1
    # With tensor_parallel > 1, how MoE experts split: "intermediate" (every device holds a
    # slice of every expert) or "expert" (whole experts per device).
    moe_sharding: str = "intermediate"

    def __post_init__(self):
        auto = [name for name in ("dtype", "attention_impl", "gdn_impl")
                if getattr(self, name) == AUTO]  # layer_loop: when the Program is built
        if auto:
            import jax  # the backend the Program will run on

            platform = jax.default_backend()
            if self.dtype == AUTO:
                object.__setattr__(self, "dtype", platform_defaults(platform)["dtype"])
            defaults = platform_defaults(platform, self.dtype)
            for name in auto:
                object.__setattr__(self, name, defaults[name])

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        checks = {
            "max_concurrency": lambda v: is_int(v) and 1 <= v <= 64,
            "page_size": lambda v: is_int(v) and v >= 1 and v & (v - 1) == 0,
            "num_pages": lambda v: is_int(v) and v >= 1,
            "max_seq_len": lambda v: is_int(v) and v >= 2,
            "prefill_chunk": lambda v: is_int(v) and v >= 1,
            "attention_impl": lambda v: v in ATTENTION_IMPLS,
            "gdn_impl": lambda v: v in GDN_IMPLS,
            "dtype": lambda v: v in DTYPES,
            "kv_dtype": lambda v: v in KV_DTYPES,
            "num_checkpoint_slots": lambda v: is_int(v) and v >= 0,
            "layer_loop": lambda v: v in LAYER_LOOPS,
            "background_compile": lambda v: isinstance(v, bool),
            "speculative": lambda v: v in SPECULATIVE,
            "num_speculative_tokens": lambda v: is_int(v) and (
                v == 0 if self.speculative == "off"
                else 1 <= v <= MAX_SPECULATIVE_TOKENS.get(self.speculative, 0)),
            "draft_head": lambda v: v in DRAFT_HEADS and (
                v == "full" or self.speculative == "dflash"),
            "draft_policy": lambda v: v in DRAFT_POLICIES,
            "max_vision_patches": lambda v: is_int(v) and (
                v == 0 or (v >= MIN_VISION_BUCKET and v & (v - 1) == 0)),
            "tensor_parallel": lambda v: is_int(v) and 1 <= v <= 512,
            "moe_sharding": lambda v: v in MOE_SHARDINGS,
        }
        limits = {
            "max_concurrency": "an integer in 1..64", "page_size": "a power-of-two integer",
            "num_pages": "an integer >= 1", "max_seq_len": "an integer >= 2",
            "prefill_chunk": "an integer >= 1",
            "attention_impl": f"one of {ATTENTION_IMPLS} or {AUTO!r}",
            "gdn_impl": f"one of {GDN_IMPLS} or {AUTO!r}",
            "dtype": f"one of {DTYPES} or {AUTO!r}", "num_checkpoint_slots": "an integer >= 0",
            "kv_dtype": f"one of {KV_DTYPES} ('auto': the program dtype)",
            "layer_loop": f"one of {LAYER_LOOPS}", "background_compile": "a bool",
            "speculative": f"one of {SPECULATIVE}",
            "num_speculative_tokens": "0 when speculative is 'off'" if self.speculative == "off"
            else f"an integer in 1..{MAX_SPECULATIVE_TOKENS.get(self.speculative)} when "
                 f"speculative is {self.speculative!r}",
            "draft_head": f"one of {DRAFT_HEADS} ('selector' only with speculative='dflash')",
            "draft_policy": f"one of {DRAFT_POLICIES}",
            "max_vision_patches": f"0 or a power of two >= {MIN_VISION_BUCKET}",
            "tensor_parallel": "an integer in 1..512 (devices)",
            "moe_sharding": f"one of {MOE_SHARDINGS}",
        }
        for name, ok in checks.items():
            value = getattr(self, name)
            if not ok(value):
                raise ConfigError(f"{name} must be {limits[name]}, got {value!r:.60}")

    def resolved_layer_loop(self) -> str:
        return resolve_layer_loop(self.layer_loop)  # when the Program is built

    @property
    def page_dtype(self) -> str:
        """What the K/V pages hold: "int8", or the program dtype."""
        return self.dtype if self.kv_dtype == AUTO else self.kv_dtype

    @property
    def verify_width(self) -> int:
        """Tokens a decode round proposes per row: the drafts and the target's next token."""
        return self.num_speculative_tokens + 1

    @property
    def round_drafts(self) -> tuple[int, ...]:
        """The draft counts K a decode round is compiled for, ascending, the last
        num_speculative_tokens: every K up to it with MTP; with DFlash 0, 1, 4 and 8 where at
        most 2/3 of it, and it (a drafter's block costs little more at 15 than at 8, the verify
        does; the demo's best fixed K on these cores is 4; a round of 2 took about as long as
        one of 1, and the policy held K = 2 where K = 4 won: drafting 2, a row never shows how
        its drafts 3 and 4 fare);
        (0,) without speculation, (K,) with draft_policy "fixed"."""
        k = self.num_speculative_tokens
        if self.speculative == "off" or self.draft_policy == "fixed":
            return (k,)
        if self.speculative == "mtp":
            return tuple(range(k + 1))
        return tuple(sorted({0, 1, k, *(n for n in (4, 8) if 3 * n <= 2 * k)}))  # K <= 15

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_seq_len // self.page_size)

    @property
    def vision_buckets(self) -> tuple[int, ...]:
        """The vision encoder's padded patch counts: 64, 128, ... max_vision_patches."""
        out, n = [], MIN_VISION_BUCKET
        while self.max_vision_patches and n <= self.max_vision_patches:
            out.append(n)
            n *= 2
        return tuple(out)

    @property
    def num_slots(self) -> int:
        """Committed GDN state slots: one per concurrently active sequence."""
        return self.max_concurrency
