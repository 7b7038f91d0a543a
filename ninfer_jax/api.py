"""The public Engine: `Engine.open(model=None, ...)` builds Frontend + Program + EngineCore.

Owns turning a model path and keyword settings into a running Engine, and the notebook-facing
calls (submit, asubmit, generate, stats). Order, lifecycle and publication stay in `engine/`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pathlib
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ninfer_jax import quant
from ninfer_jax.engine import (
    AsyncRequestHandle,
    AsyncTextStream,
    EngineCore,
    EngineCoreConfig,
    EngineStats,
    FinishReason,
    GenerationResult,
    RejectedError,
    RequestHandle,
    TextStream,
)
from ninfer_jax.errors import CheckpointError, ConfigError
from ninfer_jax.frontend import Frontend, PromptError
from ninfer_jax.sampling_params import SamplingParams, SamplingParamsError

if TYPE_CHECKING:
    from ninfer_jax.program.config import ProgramConfig
    from ninfer_jax.scoring.scorer import Scorer

_PROGRAM_KEYS = ("page_size", "num_pages", "max_seq_len", "prefill_chunk", "attention_impl",
                 "gdn_impl", "dtype", "kv_dtype", "num_checkpoint_slots", "speculative",
                 "num_speculative_tokens", "draft_head", "draft_policy", "max_vision_patches", "tensor_parallel",
                 "moe_sharding")
DEFAULT_SPECULATIVE_TOKENS = 1  # drafts per round with speculative="mtp" (docs/speculative.md)
_CORE_KEYS = ("max_queue", "queue_timeout_s", "prefix_reuse", "overlap")
_STORE_KEYS = ("context_store", "host_cache_gb", "disk_cache_dir", "redis_url")
DEFAULT_DFLASH_TOKENS = 8  # drafts per round with speculative="dflash" (docs/speculative.md)


PURPOSES = ("generation", "causal_scoring")
_LOG = logging.getLogger("ninfer_jax")


def jax_backend() -> str:
    import jax

    return jax.default_backend()


class Engine:
    """A running Engine for one purpose, fixed at start (DESIGN §1): Generation (submit,
    generate, stream) or CausalScoring (score, rolling, perplexity). Use as a context manager,
    or call `close()`."""

    def __init__(self, core: EngineCore | None, frontend: Frontend | None,
                 model_path: pathlib.Path | None, *, scorer: Scorer | None = None):
        self.core, self.frontend, self.model_path = core, frontend, model_path
        self.scorer = scorer  # the CausalScoring purpose's Scorer (None for Generation)
        self.purpose = "generation" if scorer is None else "causal_scoring"
        self._score_lock = threading.Lock()  # scoring calls run one at a time
        self._closed = False

    @classmethod
    def open(cls, model: str | pathlib.Path | None = None, *, purpose: str = "generation",
             max_concurrency: int | None = None, verify_weights: bool = True,
             progress: bool | None = None, drafter: str | pathlib.Path | None = None,
             local_media: bool | str | pathlib.Path = True, media_fetch_timeout_s: float = 0.0,
             quantize: str | None = None, **config: Any) -> Engine:
        """Loads `model` (artifact or HF checkpoint directory; None = the embedded default).

        purpose="causal_scoring": an Engine that scores texts (`score`, `rolling`,
        `perplexity`, the same results as `Scorer`); its settings are ScoringConfig's
        (window, stride, max_len, min_len, max_batch_tokens, dtype, pack, share_contexts,
        max_continuation) and its scoring windows
        compile before this returns (progress: a bar over them; None = in a notebook only).

        purpose="generation" (default): compiles the prefill step before returning; the other
        steps compile on a background thread in the order they are first needed (a request
        waits only for what it uses; `wait_compiled()` waits for all of them, with a progress
        bar in a notebook). max_concurrency: requests decoding together (default 4).
        Settings: max_seq_len, page_size, num_pages, prefill_chunk, attention_impl, gdn_impl,
        dtype (all "auto" by default: bf16 and the Pallas kernels on GPU, fp32 and the jnp
        references on CPU, see `program.config.platform_defaults`; the choice is logged and in
        `program_config`), kv_dtype ("auto": K/V pages in dtype; "int8": INT8 pages with a
        scale per token and kv head, about half the bytes of bf16 pages),
        num_checkpoint_slots, speculative ("off"; "mtp": draft num_speculative_tokens tokens
        per round with the model's MTP head, default 1, a model without MTP weights refuses
        it; "dflash": a DFlash block drafter proposes them in one pass, default 8, 1..15; the
        drafter is `drafter` (a DFlash checkpoint directory), else the model's `drafter/`
        directory, else for the embedded model the shipped demo drafter; draft_head "full",
        the default, or "selector": what turns its block into drafts; draft_policy
        "adaptive", the default: each round's K (0 included) is chosen from measured step
        times and acceptance, `engine/spec_policy.py`, or "fixed": always K) (Program);
        max_queue, queue_timeout_s, prefix_reuse (Engine; on by default), overlap (Engine:
        dispatch a decode round before the last one's output is processed; on by default);
        verify_weights (check digests and finiteness while loading, see `load_model`'s
        `verify`); quantize ("int8" | "int4": quantize a float model's weights as it loads,
        group-wise weight-only, see `ninfer_jax.quant`; an FP8 checkpoint or a quantized
        artifact loads quantized as it is). Compiled executables go to the persistent
        compilation cache that the CLI
        uses (`compile_cache.ensure_persistent_cache`: unless jax already has one configured
        or NINFER_JAX_CACHE_DIR=off), so the next process loads them instead of compiling.
        Context store (prefix checkpoints beyond the device, `context_store.py`):
        context_store (a topology dict or JSON file, or "off"; default: a host-memory tier of
        1 GiB), or the shortcuts host_cache_gb, disk_cache_dir, redis_url.
        Tensor parallel: tensor_parallel (devices the weights, K/V pages and GDN state are
        split over by head, `program.sharding`; default 1) and moe_sharding ("intermediate" or
        "expert") (Program).
        Vision (a model with a vision tower): messages may hold image and video parts
        (`frontend.media`); max_vision_patches bounds one prompt's patches (Program);
        local_media: which local image paths messages may name (True: any, False: none, a
        directory: those inside it; `ninfer serve` passes its --allowed_media_dir or False);
        media_fetch_timeout_s: http(s) image URLs are fetched within it, up to 64 MiB each
        (0, the default: never)."""
        from ninfer_jax.compile_cache import ensure_persistent_cache
        from ninfer_jax.loader import host_placement, load_model
        from ninfer_jax.program.config import ProgramConfig, engine_pools
        from ninfer_jax.program.program import Program

        if not isinstance(verify_weights, bool):
            raise ConfigError(f"verify_weights must be a bool, got {verify_weights!r:.40}")
        if progress is not None and not isinstance(progress, bool):
            raise ConfigError(f"progress must be True, False or None, got {progress!r:.40}")
        if progress is not None and purpose == "generation":
            raise ConfigError("progress is a causal_scoring setting; a generation Engine shows "
                              "its compiles with wait_compiled(progress=True)")
        if purpose not in PURPOSES:
            raise ConfigError(f"purpose must be one of {list(PURPOSES)}, got {purpose!r:.40}")
        ensure_persistent_cache()
        if purpose == "causal_scoring":
            from ninfer_jax.scoring.scorer import Scorer

            if max_concurrency is not None:
                raise ConfigError("max_concurrency is a generation setting; an Engine with "
                                  "purpose='causal_scoring' batches by max_batch_tokens")
            scorer = Scorer.open(model, verify_weights=verify_weights, progress=progress,
                                 quantize=quantize, **config)
            return cls(None, None, scorer.model_path, scorer=scorer)
        max_concurrency = 4 if max_concurrency is None else max_concurrency
        from ninfer_jax import context_store

        known = _PROGRAM_KEYS + _CORE_KEYS + _STORE_KEYS
        unknown = sorted(set(config) - set(known))
        if unknown:
            raise ConfigError(f"unknown Engine setting(s) {unknown}; known: {sorted(known)}")
        store = context_store.topology(**{k: config[k] for k in _STORE_KEYS if k in config})
        core_config = EngineCoreConfig(**{k: config[k] for k in _CORE_KEYS if k in config})
        given = {k: config[k] for k in _PROGRAM_KEYS if k in config}
        if given.get("speculative") == "mtp":
            given.setdefault("num_speculative_tokens", DEFAULT_SPECULATIVE_TOKENS)
        if given.get("speculative") == "dflash":
            given.setdefault("num_speculative_tokens", DEFAULT_DFLASH_TOKENS)
        if drafter is not None and given.get("speculative") != "dflash":
            raise ConfigError("drafter is for speculative='dflash'")
        pcfg = ProgramConfig(max_concurrency=max_concurrency, **given)  # validates every value
        defaults = engine_pools(pcfg, core_config.prefix_reuse)
        pcfg = dataclasses.replace(pcfg, **{k: v for k, v in defaults.items() if k not in given})
        placement = None
        if pcfg.resolved_layer_loop() == "unrolled":
            # kept on the host: the Program sends each layer's weights to the devices as their
            # own arrays (slicing stacked device arrays would hold every weight twice)
            placement = host_placement
        elif pcfg.tensor_parallel > 1:  # each weight straight to its devices, split
            from ninfer_jax.loader import model_config
            from ninfer_jax.program import sharding

            placement = sharding.placement(model_config(model),
                                           sharding.tp_mesh(pcfg.tensor_parallel),
                                           pcfg.moe_sharding)
        loaded = load_model(model, dtype=pcfg.dtype, verify=verify_weights, placement=placement,
                            quantize=quantize)
        try:
            if isinstance(media_fetch_timeout_s, bool) or not isinstance(
                    media_fetch_timeout_s, (int, float)) or not 0 <= media_fetch_timeout_s < 3600:
                raise ConfigError(f"media_fetch_timeout_s must be seconds in [0, 3600), got "
                                  f"{media_fetch_timeout_s!r:.40}")
            frontend = Frontend.load(loaded.path, loaded.config, local_media,
                                     media_fetch_timeout_s)
        except FileNotFoundError as e:
            raise CheckpointError(f"cannot serve {loaded.path}: {e}") from None
        params, draft_cfg = loaded.params, None
        if pcfg.speculative == "dflash":
            from ninfer_jax.loader import drafter_path, load_drafter

            draft = load_drafter(drafter_path(loaded.path, drafter), pcfg.dtype,
                                 verify=verify_weights)
            params, draft_cfg = {**params, "dflash": draft.params}, draft.config
        program = Program(loaded.config, params, pcfg, drafter=draft_cfg)
        tiers = None
        if core_config.prefix_reuse and pcfg.num_checkpoint_slots:
            # The drafter's weights and config shape its context window in every StateImage.
            identity = context_store.model_identity(
                params, loaded.config if draft_cfg is None else (loaded.config, draft_cfg),
                program.limits, pcfg.dtype if pcfg.kv_dtype == "auto"
                else f"{pcfg.dtype}, {pcfg.kv_dtype} K/V")
            tiers = context_store.open_tiers(store, program, identity)
        core = EngineCore(program, frontend, core_config, tiers)
        _LOG.info("Engine on %s: dtype %s, weights %s, K/V pages %s, attention %s, GDN %s, "
                  "max_concurrency %d, tensor_parallel %d", jax_backend(), pcfg.dtype,
                  quant.method_of(params) or pcfg.dtype, pcfg.page_dtype, pcfg.attention_impl,
                  pcfg.gdn_impl, pcfg.max_concurrency, pcfg.tensor_parallel)
        return cls(core, frontend, loaded.path)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        if self.core is not None:
            self.core.close()

    # CausalScoring ------------------------------------------------------------------------
    def score(self, texts: Sequence[str] | None = None,
              token_ids: Sequence[Sequence[int]] | None = None,
              contexts: Sequence[Any] | None = None, *, progress: bool | None = None) -> list:
        """One ScoreResult per item, in order (see `Scorer.score`); purpose='causal_scoring'."""
        scorer = self._scoring("score")
        with self._score_lock:
            return scorer.score(texts, token_ids, contexts, progress=progress)

    def rolling(self, texts: Sequence[str], *, progress: bool | None = None) -> list:
        """Each text scored in rolling windows (see `Scorer.rolling`)."""
        scorer = self._scoring("rolling")
        with self._score_lock:
            return scorer.rolling(texts, progress=progress)

    def perplexity(self, text: str | Sequence[str], *, progress: bool | None = None) -> float:
        """exp(-mean log-prob) of a text or a corpus (see `Scorer.perplexity`)."""
        scorer = self._scoring("perplexity")
        with self._score_lock:
            return scorer.perplexity(text, progress=progress)

    def _scoring(self, call: str) -> Scorer:
        if self.scorer is None:
            raise ConfigError(f"{call}() needs an Engine opened with purpose='causal_scoring'; "
                              "this one is for generation")
        if self._closed:
            raise ConfigError(f"{call}(): the Engine is closed")
        return self.scorer

    def _generation(self, call: str) -> EngineCore:
        if self.core is None:
            raise ConfigError(f"{call}() needs an Engine opened with purpose='generation'; this "
                              "one is for causal scoring (score, rolling, perplexity)")
        return self.core

    def _prepare(self, prompt, messages, prompt_token_ids, enable_thinking,
                 allow_control_tokens):
        try:
            return self.frontend.prepare(prompt=prompt, messages=messages,
                                         prompt_token_ids=prompt_token_ids,
                                         enable_thinking=enable_thinking,
                                         allow_control_tokens=allow_control_tokens)
        except PromptError as e:
            raise RejectedError("invalid", str(e), e.field) from None

    def submit(self, prompt: str | None = None, *,
               messages: Sequence[Mapping[str, Any]] | None = None,
               prompt_token_ids: Sequence[int] | None = None,
               sampling: SamplingParams | None = None, session: str | None = None,
               enable_thinking: bool | None = None, deadline_s: float | None = None,
               queue_timeout_s: float | None = None, cache_salt: str | None = None,
               allow_control_tokens: bool | None = None, prefix_reuse: bool = True,
               prepared: Any = None, _loop=None) -> RequestHandle:
        """Queues one request; returns its handle. Bad input raises RejectedError at once, before
        the request takes any capacity.

        prepared: a PreparedPrompt from `frontend.prepare` (its media and reuse boundary kept),
        instead of prompt / messages / prompt_token_ids.

        session: a prefix-reuse hint (the conversation's key). cache_salt: the request reuses
        and leaves prefix checkpoints only among requests with the same salt (a tenant).
        allow_control_tokens: see `Frontend.prepare` (default: text in messages is text).
        prefix_reuse=False: this request neither reuses nor leaves a prefix checkpoint."""
        self._generation("submit")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise RejectedError("invalid", f"cache_salt must be a string or None, got "
                                f"{type(cache_salt).__name__}", "cache_salt")
        if prepared is None:
            prepared = self._prepare(prompt, messages, prompt_token_ids, enable_thinking,
                                     allow_control_tokens)
        elif (prompt, messages, prompt_token_ids) != (None, None, None):
            raise RejectedError("invalid", "prepared is instead of prompt, messages and "
                                "prompt_token_ids; pass one", "prompt")
        return self.core.submit(prepared, _sampling(sampling), session_key=session,
                                deadline_s=deadline_s, queue_timeout_s=queue_timeout_s,
                                cache_scope=cache_salt, prefix_reuse=prefix_reuse,
                                loop=_loop)

    async def asubmit(self, prompt: str | None = None, **kwargs: Any) -> AsyncRequestHandle:
        """`submit` for asyncio code: the handle supports `async for` and `await aresult()`."""
        return self.submit(prompt, _loop=asyncio.get_running_loop(), **kwargs)

    async def aprime_prefix(self, prompt_token_ids: Sequence[int], *,
                            cache_salt: str | None = None) -> bool:
        """Leaves a prefix checkpoint at `prompt_token_ids` minus its last token (by running that
        prefix for one greedy token), so several requests with this prompt each prefill only
        its last token (a checkpoint at the whole prompt cannot serve it: the last prompt token
        is always run to sample the first). A hint: False when prefix reuse is off, the prompt
        is one token, or the Engine refused it (then the requests simply prefill in full)."""
        ids = list(prompt_token_ids)
        if not self._generation("aprime_prefix").reuse or len(ids) < 2:
            return False
        try:
            handle = await self.asubmit(prompt_token_ids=ids[:-1], cache_salt=cache_salt,
                                        sampling=SamplingParams(temperature=0.0,
                                                                max_new_tokens=1))
        except RejectedError:
            return False
        try:
            return (await handle.aresult()).error is None
        finally:
            handle.release()

    def generate(self, prompt: str | None = None, **kwargs: Any) -> GenerationResult:
        """Blocking one-liner: submit and wait for the result. Interrupted (a KeyboardInterrupt
        in a notebook cell), it cancels the request and waits for the Engine to free it before
        the exception goes on."""
        handle = self.submit(prompt, **kwargs)
        try:
            return handle.result()
        except BaseException:
            handle.close()
            raise

    def stream(self, prompt: str | None = None, **kwargs: Any) -> TextStream:
        """`for delta in engine.stream(prompt, ...)`: the answer's Deltas as they are committed
        (arguments as `submit`); see TextStream for how leaving early ends the request."""
        return TextStream(self.submit(prompt, **kwargs))

    def astream(self, prompt: str | None = None, **kwargs: Any) -> AsyncTextStream:
        """`async for delta in engine.astream(prompt, ...)`: `stream` for asyncio code, called
        on a running event loop (a coroutine, or a Jupyter cell: its loop is already running)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError("astream() needs a running event loop (call it from async "
                               "code); use stream() in synchronous code") from None
        return AsyncTextStream(self.submit(prompt, _loop=loop, **kwargs))

    def wait_compiled(self, progress: bool | None = None) -> None:
        """Waits until every step executable is compiled (they compile in the background after
        `open`), with a progress bar (None: in a notebook only), and, while no request is being
        served, until the worker has run each decode round once (an executable's first run is
        several times its steady time: `Program.warm_up_next`)."""
        core = self._generation("wait_compiled")
        core.program.wait_compiled(progress)
        core.wait_warm()

    def warm_up(self) -> float:
        """Serves one short request through the Engine (prefill, then decode rounds at B=1)
        with prefix reuse off, so it leaves no checkpoint; a server calls it before it reports
        ready, so the first client does not wait for first-use work (the decode step's
        compile, the first dispatches). Returns its seconds."""
        start = time.perf_counter()
        result = self.submit(prompt_token_ids=[0], prefix_reuse=False, sampling=SamplingParams(
            max_new_tokens=4, temperature=0.0)).result()
        if result.finish_reason is FinishReason.ERROR:
            raise RuntimeError(f"the warm-up request failed: {result.error}")
        return time.perf_counter() - start

    def stats(self) -> EngineStats:
        return self._generation("stats").stats()

    @property
    def outstanding(self) -> int:
        """Requests holding capacity now (`stats().outstanding` is the worker's last snapshot,
        which lags a consumer's release by up to one worker iteration)."""
        return self._generation("outstanding").outstanding

    @property
    def available(self) -> bool:
        """False once the Engine failed or was closed (it then rejects every submit)."""
        return not self._closed if self.core is None else self.core.available

    @property
    def program_config(self) -> ProgramConfig | None:
        """The Program's resolved ProgramConfig (dtype, attention_impl, pool sizes, ...); None
        for a Program without one (a test double)."""
        return getattr(self._generation("program_config").program, "pcfg", None)

    def describe(self) -> str:
        """One line: the backend and the settings chosen for it."""
        pcfg = self.program_config
        if pcfg is None:
            return (f"{type(self.core.program).__name__}, max_concurrency "
                    f"{self.core.limits.max_concurrency}")
        line = (f"{jax_backend()}: dtype {pcfg.dtype}, attention {pcfg.attention_impl}, "
                f"GDN {pcfg.gdn_impl}, max_concurrency {pcfg.max_concurrency}")
        method = quant.method_of(getattr(self.core.program, "params", {}))
        if method is not None:
            line += f", {method} weights"
        if pcfg.kv_dtype != "auto":
            line += f", {pcfg.kv_dtype} K/V pages"
        if pcfg.tensor_parallel > 1:
            line += f", tensor_parallel {pcfg.tensor_parallel}"
        if pcfg.speculative != "off":
            line += f", speculative {pcfg.speculative} K={pcfg.num_speculative_tokens}"
        if getattr(self.core.program, "vision_on", False):
            line += f", vision up to {pcfg.max_vision_patches} patches a prompt"
        return line

    @property
    def max_seq_len(self) -> int:
        """The context limit: prompt + generated tokens of one request."""
        return self._generation("max_seq_len").limits.max_seq_len

    def clear_prefix_cache(self) -> None:
        """Releases every inactive prefix checkpoint."""
        self._generation("clear_prefix_cache").clear_prefix_cache()


def _sampling(sampling: SamplingParams | None) -> SamplingParams:
    if sampling is None:
        return SamplingParams()
    if isinstance(sampling, Mapping):
        try:
            return SamplingParams(**sampling)
        except (TypeError, SamplingParamsError) as e:
            raise RejectedError("invalid", f"sampling: {e}", "sampling") from None
    if not isinstance(sampling, SamplingParams):
        raise RejectedError("invalid", f"sampling must be a SamplingParams, got "
                            f"{type(sampling).__name__}", "sampling")
    return sampling
