"""The DFlash block drafter's static configuration, read from the public checkpoint layout.

A DFlash checkpoint's config.json is a Qwen3 decoder config (`hidden_size`, `num_hidden_layers`,
heads, `layer_types`, `sliding_window`, `rope_parameters`) with the drafter's own fields under
`dflash_config`: `block_size`, `mask_token_id`, `target_layer_ids` (the target layers whose
outputs the drafter reads, HF's `hidden_states[i + 1]`), and for DFlash2 the grouped dynamic
convolutions (`conv_kernel_size`, `conv_group_size`), the candidate selector (`selector_rank`,
`selector_top_k`), `final_logit_softcapping` and `output_multiplier`. A DFlash (v1) checkpoint
has none of the DFlash2 fields; its drafts come from the full lm-head proposal only.

Owns validation: every refusal names the field and the limit (`CheckpointError`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ninfer_jax.errors import CheckpointError

SLIDING = "sliding_attention"
FULL = "full_attention"
ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    layer_types: tuple[str, ...]  # per layer: "sliding_attention" or "full_attention"
    sliding_window: int  # keys with |query - key| >= this are hidden in sliding layers
    causal: tuple[bool, ...]  # per layer: a block position sees only block positions <= it
    block_size: int  # positions of a trained block: the anchor and block_size - 1 drafts
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    conv_kernel_size: int = 0  # 0: no grouped dynamic convolutions (DFlash v1)
    conv_group_size: int = 0
    selector_rank: int = 0  # 0: no candidate selector (the full lm-head proposal only)
    selector_top_k: int = 0
    final_logit_softcapping: float = 0.0  # 0: none
    output_multiplier: float = 1.0
    input_embedding_scale: float = 1.0

    @property
    def has_conv(self) -> bool:
        return self.conv_kernel_size > 0

    @property
    def has_selector(self) -> bool:
        return self.selector_rank > 0

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def bounded_window(self) -> int | None:
        """How far back any block position sees into the context when every layer slides
        (`sliding_window`); None when a full-attention layer sees all of it."""
        return self.sliding_window if all(t == SLIDING for t in self.layer_types) else None

    @classmethod
    def from_hf_dict(cls, config: dict[str, Any]) -> DFlashConfig:
        """From a DFlash checkpoint's config.json."""
        arch = config.get("architectures") or []
        if not any(a in ARCHITECTURES for a in arch):
            raise CheckpointError(f"architectures must name one of {ARCHITECTURES}, got {arch}")
        draft = config.get("dflash_config")
        if not isinstance(draft, dict):
            raise CheckpointError("config.json has no 'dflash_config' object")

        def need(source: dict, key: str, where: str = "") -> Any:
            if key not in source:
                raise CheckpointError(f"config.json has no '{where}{key}'")
            return source[key]

        def value(key: str, default: Any = None) -> Any:
            return draft.get(key, config.get(key, default))

        num_layers = int(need(config, "num_hidden_layers"))
        layer_types = tuple(config.get("layer_types") or [FULL] * num_layers)
        is_causal = config.get("is_causal")
        # The reference: sliding layers are causal unless `is_causal` says otherwise.
        causal = tuple((t == SLIDING) if is_causal is None else bool(is_causal)
                       for t in layer_types)
        rope = config.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise CheckpointError(
                f"rope_parameters.rope_type must be 'default', got {rope.get('rope_type')!r}")
        if config.get("attention_bias"):
            raise CheckpointError("attention_bias must be false (no drafter uses biases)")
        hidden = int(need(config, "hidden_size"))
        heads = int(need(config, "num_attention_heads"))
        window = config.get("sliding_window")
        target_ids = value("target_layer_ids")
        if target_ids is None:
            raise CheckpointError("config.json has no 'dflash_config.target_layer_ids'")
        mask_id = value("mask_token_id")
        if mask_id is None:
            raise CheckpointError("config.json has no 'dflash_config.mask_token_id'")
        softcap = value("final_logit_softcapping")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(need(config, "intermediate_size")),
            num_layers=num_layers,
            num_q_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads", heads)),
            head_dim=int(config.get("head_dim", hidden // heads)),
            vocab_size=int(need(config, "vocab_size")),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            layer_types=layer_types,
            sliding_window=int(window) if window is not None else 0,
            causal=causal,
            block_size=int(value("block_size", 16)),
            mask_token_id=int(mask_id),
            target_layer_ids=tuple(int(i) for i in target_ids),
            conv_kernel_size=int(value("conv_kernel_size", 0) or 0),
            conv_group_size=int(value("conv_group_size", 0) or 0),
            selector_rank=int(value("selector_rank", 0) or 0),
            selector_top_k=int(value("selector_top_k", 0) or 0),
            final_logit_softcapping=float(softcap) if softcap else 0.0,
            output_multiplier=float(value("output_multiplier", 1.0)),
            input_embedding_scale=float(value("input_embedding_scale", 1.0)),
        )

    def __post_init__(self):
        checks = {
            "num_hidden_layers": (self.num_layers >= 1, "an integer >= 1"),
            "layer_types": (len(self.layer_types) == self.num_layers
                            and all(t in (SLIDING, FULL) for t in self.layer_types),
                            f"{self.num_layers} entries of {SLIDING!r} or {FULL!r}"),
            "num_attention_heads": (self.num_q_heads >= 1
                                    and self.num_q_heads % max(self.num_kv_heads, 1) == 0,
                                    "a multiple of num_key_value_heads"),
            "head_dim": (self.head_dim >= 2 and self.head_dim % 2 == 0, "an even integer >= 2"),
            "sliding_window": (SLIDING not in self.layer_types or self.sliding_window >= 1,
                               "an integer >= 1 when a layer is sliding_attention"),
            "dflash_config.block_size": (2 <= self.block_size <= 64, "an integer in 2..64"),
            "dflash_config.mask_token_id": (0 <= self.mask_token_id < self.vocab_size,
                                            f"a token id below vocab_size {self.vocab_size}"),
            "dflash_config.target_layer_ids": (len(self.target_layer_ids) >= 1
                                               and min(self.target_layer_ids) >= 0,
                                               "a non-empty list of layer indices"),
            "dflash_config.conv_group_size": (
                not self.has_conv or (self.conv_group_size >= 1
                                      and self.hidden_size % self.conv_group_size == 0),
                f"a divisor of hidden_size {self.hidden_size}"),
            "dflash_config.selector_top_k": (
                not self.has_selector or 1 <= self.selector_top_k <= self.vocab_size,
                f"an integer in 1..{self.vocab_size} with a selector"),
        }
        for name, (ok, limit) in checks.items():
            if not ok:
                raise CheckpointError(f"{name} must be {limit}")

    def check_target(self, num_target_layers: int, target_hidden: int, target_vocab: int):
        """The drafter reads a target with these dimensions: refuses a mismatch by name."""
        if self.hidden_size != target_hidden:
            raise CheckpointError(f"the drafter's hidden_size {self.hidden_size} must equal the "
                                  f"target's hidden_size {target_hidden}")
        if self.vocab_size != target_vocab:
            raise CheckpointError(f"the drafter's vocab_size {self.vocab_size} must equal the "
                                  f"target's vocab_size {target_vocab}")
        if max(self.target_layer_ids) >= num_target_layers:
            raise CheckpointError(
                f"dflash_config.target_layer_ids {list(self.target_layer_ids)} must be below "
                f"the target's {num_target_layers} layers")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DFlashConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in fields}
        for key in ("layer_types", "causal", "target_layer_ids"):
            d[key] = tuple(d[key])
        return cls(**d)
