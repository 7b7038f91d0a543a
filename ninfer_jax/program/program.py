"""Program: the only entry to physical execution for one model package (DESIGN §2, §10).

Owns the device pools and the compiled step table; the host bookkeeping it shares with its test
double lives in `host.py`. It knows nothing of requests, queues, text or users. All executables
(`executable_specs.program_executables`: prefill chunk, decode for every exact B, commit,
capture, restore, and the copies of checkpoint images to and from the host) are compiled at
start-up: the prefill step before the constructor returns, the rest on a background thread in
the order they are first needed (decode B = 1 first), unless `ProgramConfig.background_compile`
is off; `wait_compiled()` waits for all of them.

A commit is applied by the next prefill or decode step (its `commit` input) rather than by a
dispatch of its own, so a steady decode round is one dispatch; `pools` (and every step that
takes no commit) applies it first, so the committed state anyone reads is always current.
"""

from __future__ import annotations

import jax
import numpy as np

from ninfer_jax import quant
from ninfer_jax.errors import ConfigError
from ninfer_jax.host_memory import keep_freed_memory
from ninfer_jax.models.dflash import DFlashConfig
from ninfer_jax.models.qwen3_6 import ModelConfig
from ninfer_jax.models.qwen3_6.model import unstack_layers
from ninfer_jax.models.qwen3_6.mrope import rope_index
from ninfer_jax.models.qwen3_6.vision import vision_layout
from ninfer_jax.program.checkpoints import CheckpointImage, CheckpointRecord
from ninfer_jax.program.config import ProgramConfig
from ninfer_jax.program.errors import InfeasibleError, PendingBatchError
from ninfer_jax.program.executable_specs import (
    PAGE_GROUP,
    bare_window,
    image_pools,
    lean_rounds,
    no_commit,
    page_parts,
    program_executables,
    reads_ring,
    round_key,
    round_params,
    round_pools,
    round_width,
    vision_on,
    with_images,
)
from ninfer_jax.program.executables import ExecutableTable, StepKey, StepKind
from ninfer_jax.program.host import GREEDY, HostProgram
from ninfer_jax.program.limits import ProgramLimits
from ninfer_jax.program.pools import Pools
from ninfer_jax.program.sampling import sampling_arrays
from ninfer_jax.program.sequences import SeqRecord
from ninfer_jax.program.sharding import place_params, pool_shardings, tp_mesh
from ninfer_jax.program.steps import (
    CaptureInputs,
    CommitInputs,
    DecodeInputs,
    PageImport,
    PageRows,
    PrefillInputs,
    RestoreInputs,
    StateImport,
    StateRow,
    VisionEncodeInputs,
)
from ninfer_jax.progress import bar


class Program(HostProgram):
    """Pools, allocators, sequences and the compiled steps of one model package."""

    def __init__(self, cfg: ModelConfig, params: dict, pcfg: ProgramConfig, *,
                 executables: ExecutableTable | None = None,
                 drafter: DFlashConfig | None = None):
        """`executables`: where the steps compile (default a new ExecutableTable).
        `drafter`: the DFlash drafter's config, with
        speculative="dflash" (its weights are `params["dflash"]`)."""
        keep_freed_memory()
        if pcfg.max_seq_len > cfg.max_position_embeddings:
            raise InfeasibleError(
                f"max_seq_len {pcfg.max_seq_len} exceeds the model's max_position_embeddings "
                f"{cfg.max_position_embeddings}")
        mtp_layers = 0
        if pcfg.speculative == "mtp":
            if "mtp" not in params:
                raise ConfigError("speculative='mtp' needs a model with MTP weights (mtp.*); "
                                  "this model has none (speculative must be 'off')")
            mtp_layers = len(params["mtp"]["layers"]["input_norm"])
        _check_drafter(cfg, params, pcfg, drafter)
        self.drafter = drafter
        self.mesh = tp_mesh(pcfg.tensor_parallel)
        pools = _allocate(cfg, pcfg, mtp_layers, drafter, self.mesh)
        super().__init__(ProgramLimits(
            max_seq_len=pcfg.max_seq_len, page_size=pcfg.page_size, total_pages=pcfg.num_pages,
            total_slots=pcfg.num_slots, max_concurrency=pcfg.max_concurrency,
            prefill_chunk=pcfg.prefill_chunk, vocab_size=cfg.vocab_size,
            total_checkpoint_slots=pcfg.num_checkpoint_slots,
            page_bytes=sum(a.nbytes for a in pools.kv) // (pcfg.num_pages + 1),
            checkpoint_state_bytes=sum(a.nbytes for a in image_pools(pools))
            // max(pcfg.num_checkpoint_slots, 1),
            verify_width=pcfg.verify_width,
            rewrites_below_frontier=int(pcfg.speculative == "mtp"),
            speculative=pcfg.speculative, round_drafts=pcfg.round_drafts,
            context_window=bare_window(pcfg, drafter)))
        self.cfg, self.pcfg = cfg, pcfg
        # The vision path: a tower whose special tokens are in the vocabulary, and buckets.
        self.vision_on = vision_on(cfg, pcfg, params)
        unrolled = pcfg.resolved_layer_loop() == "unrolled"
        if self.mesh is None:  # layers split first: host params become per-layer device arrays
            self.params = quant.cast_params(unstack_layers(params, cfg) if unrolled else params,
                                            pcfg.dtype)
        else:  # each leaf cast and sent to its devices in turn (per layer when unrolled)
            self.params = place_params(
                params, cfg, self.mesh, pcfg.dtype, pcfg.moe_sharding,
                prepare=(lambda p: unstack_layers(p, cfg)) if unrolled else (lambda p: p))
        # what each kind of decode round's call passes: (drafts > 0, bare) -> params
        self._round_params = {(d, b): round_params(self.params, pcfg, d, b)
                              for d in (0, 1) for b in (False, True)}
        self._pools = pools
        self._deferred: CommitInputs | None = None  # the last commit, applied by the next step
        # The commit and the decode rounds (by B, then K) that no step has run yet:
        # `warm_up_next` runs them.
        self._cold = dict.fromkeys([StepKey(StepKind.COMMIT, pcfg.max_concurrency)] + [
            round_key(pcfg, b, k) for b in range(1, pcfg.max_concurrency + 1)
            for k in pcfg.round_drafts] + [
            round_key(pcfg, b, 0, bare=True) for b in range(1, pcfg.max_concurrency + 1)
            if self.limits.context_window] + [
            round_key(pcfg, b, 0, lean=True) for b in range(1, pcfg.max_concurrency + 1)
            if lean_rounds(pcfg)])
        self._lean = lean_rounds(pcfg)
        self.lean_rounds = 0  # rounds of 0 that wrote only their own position's head K/V
        self._sampling_key: tuple | None = None  # the rows `_sampling_last` was built for
        self._sampling_last = None
        self.executables = ExecutableTable() if executables is None else executables
        self._ready_rounds: set[tuple[int, int, bool]] = set()  # `round_ready` said so
        self.executables.mesh = self.mesh  # every step runs on the Program's devices
        self._compile_all()

    @property
    def pools(self) -> Pools:
        """The device pools with every commit applied."""
        self._flush()
        return self._pools

    def wait_compiled(self, progress: bool | None = False) -> None:
        """Returns once every executable is compiled (they compile in the background); with
        `progress`, a bar counts them (None: in a notebook only, see `ninfer_jax.progress`)."""
        keys = self.executables.keys()
        with bar(progress, len(keys), "compiling executables", "exe") as b:
            b.update(len(keys) - len(self.executables.pending()))
            self.executables.wait(on_ready=lambda key: b.update(1))

    def round_ready(self, drafts: int, batch: int, bare: bool = False) -> bool:
        """Remembered once true: a compiled executable stays (`decode` asks every bare
        round)."""
        if (drafts, batch, bare) in self._ready_rounds:
            return True
        if not self.executables.is_ready(round_key(self.pcfg, batch, drafts, bare)):
            return False
        self._ready_rounds.add((drafts, batch, bare))
        return True

    def warm_up_next(self) -> bool:
        """Runs one compiled decode round (or the standalone commit) that no step ran yet, on
        the sink (`run_idle`), so that a request's first round at a new B or K does not pay
        an executable's first run: on XLA:CPU 30-140 ms against 3-15 ms steady for the demo
        model's rounds. Only between steps (with a batch pending nothing runs). True if it
        ran one."""
        if self._pending is not None:
            return False
        key = next((k for k in self._cold if self.executables.is_ready(k)), None)
        if key is None:
            return False
        self.run_idle(key)
        return True

    def run_idle(self, key: StepKey) -> None:
        """Runs the commit or a decode round `key` with every row on the sink slot and the
        sink pages: no sequence's or checkpoint's state changes (the last commit is applied
        first). Not while a batch is pending."""
        if self._pending is not None:
            raise PendingBatchError("a batch is pending: commit it first")
        self._cold.pop(key, None)
        self._flush()
        if key.kind is StepKind.COMMIT:
            self._pools = self.executables(key, self._pools, self._no_commit(key.batch))
            return
        b, sink = key.batch, self.pcfg.num_slots
        drafts = key.extra[0] if key.extra else self.pcfg.num_speculative_tokens
        inputs = DecodeInputs(
            commit=self._no_commit(b, round_width(self.pcfg, drafts)),
            token_ids=np.zeros(b, np.int32),
            positions=np.ones(b, np.int32), slots=np.full(b, sink, np.int32),
            page_tables=np.full((b, self.pcfg.max_pages_per_seq), self.pcfg.num_pages,
                                np.int32),
            sampling=sampling_arrays([GREEDY] * b, mask_words=self.limits.mask_words),
            step_index=np.zeros(b, np.int32), limit=np.full(b, drafts + 1, np.int32),
            rope_delta=np.zeros(b, np.int32) if self.vision_on else None,
            context_from=np.zeros(b, np.int32) if reads_ring(self.pcfg, drafts) else None)
        bare = key.extra[1:] == (1,)
        params = self._round_params[drafts > 0, bare]
        pools, _ = self.executables(key, params, round_pools(self._pools, bare), inputs)
        self._pools = with_images(pools, self._pools)

    @property
    def cold_rounds(self) -> int:
        """Decode rounds (B, K) and commits no step has run yet."""
        return len(self._cold)

    def hold_compiles(self, held: bool) -> None:
        self.executables.hold(held)

    def close(self) -> None:
        """Drops the background compiles not started yet; the Program serves no more steps."""
        self.executables.close()

    def _compile_all(self) -> None:
        later = self.pcfg.background_compile
        for spec in program_executables(self.cfg, self.pcfg, self.params, self._pools,
                                        self.drafter):
            self.executables.compile(spec.key, spec.fn, *spec.args,
                                     background=spec.background and later, donate=spec.donate)

    def _page_parts(self) -> list[tuple[tuple[int, ...], np.dtype]]:
        return page_parts(self._pools, self.pcfg)

    def _no_commit(self, rows: int, width: int | None = None) -> CommitInputs:
        return no_commit(self.pcfg, rows, width)

    def _take_commit(self, rows: int, width: int | None = None) -> CommitInputs:
        """The deferred commit, sized for a step of `rows` batch rows and `width` tokens a row
        (default verify_width), which applies it first. One of more rows (the previous batch
        was larger) or of a row that keeps more than `width` tokens (a verify round's, before
        a round of 0) runs on its own first. Its tokens past a row's count are never read: a
        narrower one is padded with zeros, a wider one cut (on the host: a round's tokens
        still on the device are waited for, which a chain of rounds of 0 never needs)."""
        width = width or self.pcfg.verify_width
        commit, self._deferred = self._deferred, None
        if commit is None:
            return self._no_commit(rows, width)
        have = commit.tokens.shape[1]
        if len(commit.slots) > rows or (have > width and int(commit.num.max()) > width):
            self._apply(commit)
            return self._no_commit(rows, width)
        if len(commit.slots) == rows and have == width:
            return commit
        return self._fit(commit, rows, width)

    def _fit(self, commit: CommitInputs, rows: int, width: int | None = None) -> CommitInputs:
        """`commit` as one of `rows` >= its rows and `width` tokens a row (the rows past its
        own move nothing; its tokens cut or padded with zeros)."""
        padded = self._no_commit(rows, width)
        n, w = len(commit.slots), min(commit.tokens.shape[1], padded.tokens.shape[1])
        for name in ("slots", "num", "count"):
            getattr(padded, name)[:n] = getattr(commit, name)
        padded.tokens[:n, :w] = np.asarray(commit.tokens)[:, :w]
        return padded

    def _apply(self, commit: CommitInputs) -> None:
        key = StepKey(StepKind.COMMIT, self.pcfg.max_concurrency)
        self._cold.pop(key, None)
        self._pools = self.executables(key, self._pools, self._fit(commit, key.batch))

    def _flush(self) -> None:
        commit, self._deferred = self._deferred, None
        if commit is not None:
            self._apply(commit)

    # Vision ----------------------------------------------------------------------------------
    def _prepare_media(self, prompt_ids: list[int], media) -> tuple:
        if not self.vision_on:
            why = ("the model has no vision tower" if self.cfg.vision is None else
                   "max_vision_patches is 0" if not self.pcfg.vision_buckets else
                   "its vision tokens are not in its vocabulary")
            raise InfeasibleError(f"this Program takes no images or videos: {why}")
        if self.pcfg.speculative == "dflash":
            raise InfeasibleError("images and videos are not supported with speculative="
                                  "'dflash' (its drafter reads text positions only; use 'mtp' "
                                  "or 'off')")
        v = self.cfg.vision
        for i, m in enumerate(media):
            if m.kind not in ("image", "video") or m.patches.ndim != 2 \
                    or m.patches.shape[1] != v.patch_dim \
                    or m.patches.shape[0] != m.grid[0] * m.grid[1] * m.grid[2]:
                raise InfeasibleError(
                    f"media[{i}]: {m.kind} patches of shape {m.patches.shape} and grid "
                    f"{m.grid} do not fit the vision tower ({v.patch_dim} values a patch; "
                    f"preprocess with the model's processor settings)")
        total = sum(m.patches.shape[0] for m in media)
        if total > self.pcfg.max_vision_patches:
            raise InfeasibleError(
                f"the prompt's images and videos have {total} patches, more than "
                f"max_vision_patches {self.pcfg.max_vision_patches} (resize them, or raise it)")
        try:
            rope = rope_index(prompt_ids, self.cfg,
                              image_grids=[m.grid for m in media if m.kind == "image"],
                              video_grids=[m.grid for m in media if m.kind == "video"])
        except ValueError as e:
            raise InfeasibleError(f"prompt and media do not match: {e}") from None
        ids = np.asarray(prompt_ids)
        token = {"image": self.cfg.image_token_id, "video": self.cfg.video_token_id}
        at = np.flatnonzero(np.isin(ids, list(token.values())))
        where = {kind: at[ids[at] == t] for kind, t in token.items()}
        starts, used = [], {"image": 0, "video": 0}
        for m in media:  # each kind's placeholders taken in prompt order (rope_index checked)
            starts.append(int(where[m.kind][used[m.kind]]))
            used[m.kind] += m.num_tokens
        return rope, at.astype(np.int32), tuple(starts)

    def encode_media(self, media) -> np.ndarray:
        """The vision tower's embeddings [M, H] of images/videos (VisionInput, packed in order:
        M is their placeholder count), through the smallest compiled bucket that holds them."""
        if not self.vision_on:
            raise InfeasibleError("this Program takes no images or videos")
        v = self.cfg.vision
        n = sum(m.patches.shape[0] for m in media)
        bucket = next((b for b in self.pcfg.vision_buckets if b >= n), None)
        if bucket is None:
            raise InfeasibleError(f"{n} patches, more than max_vision_patches "
                                  f"{self.pcfg.max_vision_patches}")
        layout = vision_layout([m.grid for m in media], v, bucket)
        patches = np.zeros((bucket, v.patch_dim), np.float32)
        patches[:n] = np.concatenate([m.patches for m in media])
        out = self.executables(StepKey(StepKind.VISION_ENCODE, 1, bucket), self.params["vision"],
                               VisionEncodeInputs(patches, *layout.arrays()))
        return np.asarray(out)[: n // v.merge_unit]

    def vision_workspace_bytes(self) -> int:
        """The Vision region: the vision encoder's working memory at its largest bucket
        (its patches, embeddings and XLA temporaries), allocated per call beside the pools,
        never from the KV pages. 0 without the vision path. Waits for the encoder's compile."""
        if not self.vision_on:
            return 0
        m = self.executables.memory(StepKey(StepKind.VISION_ENCODE, 1,
                                            self.pcfg.vision_buckets[-1]))
        weights = sum(a.nbytes for a in jax.tree.leaves(self.params["vision"]))
        return m["argument"] - weights + m["output"] + m["temp"]

    def _run_encode(self, seq: SeqRecord):
        return self.encode_media(seq.media)

    def _vision_rows(self, seq: SeqRecord | None, start: int, n: int) -> dict:
        """The prefill chunk's vision fields (none without the vision path): MRoPE positions
        (the prompt's, or start + 0..C-1 in every row) and the embeddings at placeholders."""
        if not self.vision_on:
            return {}
        c, h = self.pcfg.prefill_chunk, self.cfg.hidden_size
        rope = np.broadcast_to(np.arange(start, start + c, dtype=np.int32), (3, c)).copy()
        embeds = np.zeros((1, c, h), self.params["embed"].dtype)
        mask = np.zeros((1, c), bool)
        if seq is not None and seq.rope is not None:
            prompt = seq.rope.positions[:, start:start + n]
            rope[:, :prompt.shape[1]] = prompt
            rope[:, prompt.shape[1]:] += seq.rope.delta  # generated text after the prompt
            inside = (seq.vision_at >= start) & (seq.vision_at < start + n)
            if inside.any():
                mask[0, seq.vision_at[inside] - start] = True
                embeds[0, seq.vision_at[inside] - start] = seq.vision_embeds[inside]
        return {"rope_positions": rope[:, None], "vision_embeds": embeds, "vision_mask": mask}

    def _run_prefill(self, seq: SeqRecord, start: int, chunk: list[int]) -> int:
        c, n = self.pcfg.prefill_chunk, len(chunk)
        inputs = PrefillInputs(
            commit=self._take_commit(1), token_ids=np.array([chunk + [0] * (c - n)], np.int32),
            start_pos=np.array([start], np.int32), num_valid=np.array([n], np.int32),
            page_table=self._page_table([seq]), slot=np.array([seq.slot], np.int32),
            reset=np.array([start == 0]), sampling=self._sampling([seq]),
            step_index=np.array([start + n], np.int32), **self._vision_rows(seq, start, n))
        self._pools, out = self.executables(StepKey(StepKind.PREFILL, 1), self.params,
                                            self._pools, inputs)
        return int(np.asarray(out.tokens)[0, 0]), _logprobs([seq], out)

    def _run_decode(self, seqs: list[SeqRecord], limits: np.ndarray, last=None,
                    drafts: int | None = None, bare: bool = False) -> tuple:
        drafts = self.pcfg.num_speculative_tokens if drafts is None else drafts
        inputs = DecodeInputs(
            commit=self._take_commit(len(seqs), round_width(self.pcfg, drafts)),
            token_ids=np.array([s.tokens[-1] for s in seqs], np.int32) if last is None
            else last,
            positions=np.array([s.frontier for s in seqs], np.int32),
            slots=np.array([s.slot for s in seqs], np.int32),
            page_tables=self._page_table(seqs),
            sampling=self._sampling(seqs),
            step_index=np.array([s.frontier + 1 for s in seqs], np.int32), limit=limits,
            rope_delta=np.array([0 if s.rope is None else s.rope.delta for s in seqs],
                                np.int32) if self.vision_on else None,
            context_from=np.array([s.context_from for s in seqs], np.int32)
            if reads_ring(self.pcfg, drafts) else None)
        key = round_key(self.pcfg, len(seqs), drafts, bare)
        if self._lean and not bare and drafts == 0 and all(s.after_decode for s in seqs):
            lean = round_key(self.pcfg, len(seqs), 0, lean=True)
            if self.executables.is_ready(lean):
                key = lean  # the same tokens; the head's K/V at frontier - 1 is written
                self.lean_rounds += 1
        self._cold.pop(key, None)
        pools, out = self.executables(key, self._round_params[drafts > 0, bare],
                                      round_pools(self._pools, bare), inputs)
        self._pools = with_images(pools, self._pools)
        # On the device; the PendingBatch reads them when asked. A round of no drafts
        # proposes one token a row: nothing to read back for that.
        produced = 1 if drafts == 0 else out.num
        return out.tokens, produced, _logprobs(seqs, out), out.last

    def _run_commit(self, seqs: list[SeqRecord], accepted: np.ndarray, tokens: np.ndarray,
                    count: bool) -> None:
        self._flush()  # at most one commit waits for the next step
        sink = self.pcfg.num_slots
        rows = accepted.tolist()
        if not isinstance(tokens, jax.Array):  # a round's tokens stay where its step left them
            tokens = np.asarray(tokens, np.int32)
        self._deferred = CommitInputs(
            slots=np.array([s.slot if a > 0 else sink for s, a in zip(seqs, rows)], np.int32),
            tokens=tokens, num=np.array([max(a, 1) for a in rows], np.int32),
            count=np.full(len(seqs), count))

    def _run_capture(self, seq: SeqRecord, ckpt_slot: int) -> None:
        inputs = CaptureInputs(slot=np.array([seq.slot], np.int32),
                               ckpt_slot=np.array([ckpt_slot], np.int32),
                               frontier=np.array([seq.frontier], np.int32),
                               context_from=np.array([seq.context_from], np.int32))
        self._pools = self.executables(StepKey(StepKind.CAPTURE, 1), self.pools, inputs)

    def _run_restore(self, ckpt: CheckpointRecord, seq: SeqRecord,
                     copy_page: tuple[int, int] | None) -> None:
        prefix = np.zeros((1, self.pcfg.max_seq_len), np.int32)
        prefix[0, : ckpt.frontier] = ckpt.tokens
        src, dst = copy_page or (seq.pages[0], seq.pages[0])
        inputs = RestoreInputs(
            ckpt_slot=np.array([ckpt.slot], np.int32), slot=np.array([seq.slot], np.int32),
            prefix_ids=prefix, prefix_len=np.array([ckpt.frontier], np.int32),
            copy_src=np.array([src], np.int32), copy_dst=np.array([dst], np.int32))
        self._pools = self.executables(StepKey(StepKind.RESTORE, 1), self.pools, inputs)

    def _run_export(self, ckpt: CheckpointRecord, pages) -> CheckpointImage:
        g, sink = PAGE_GROUP, self.pcfg.num_pages
        self._flush()
        copies = []
        for start in range(0, len(pages), g):
            part = list(pages[start:start + g])
            rows = np.full(g, sink, np.int32)
            rows[: len(part)] = [ckpt.pages[i] for i in part]
            self._pools, kv = self.executables(StepKey(StepKind.EXPORT_PAGES, g), self._pools,
                                               PageRows(rows))
            copies.append((part, kv))
        self._pools, state = self.executables(StepKey(StepKind.EXPORT_STATE, 1), self._pools,
                                              StateRow(np.array([ckpt.slot], np.int32)))
        out: list[list[np.ndarray]] = [[] for _ in ckpt.pages]
        for part, kv in copies:
            kv = [np.asarray(a) for a in kv]
            for row, i in enumerate(part):
                out[i] = [np.array(a[row]) for a in kv]
        last = len(ckpt.pages) - 1
        # the tail page: only what the tokens determine (engine/blocks.py); INT8 pages' scales
        # are zeroed with their positions
        if out[last]:
            used = ckpt.frontier - last * self.pcfg.page_size
            mtp = self.cfg.num_attention_layers
            for part in out[last]:
                part[:, used:] = 0
                if self.limits.rewrites_below_frontier:
                    part[mtp:, used - self.limits.rewrites_below_frontier:] = 0
        state = np.concatenate([np.asarray(a).reshape(-1).view(np.uint8) for a in state])
        return CheckpointImage(ckpt.tokens, out, state, media=ckpt.media)

    def _run_import(self, ckpt: CheckpointRecord, image: CheckpointImage) -> None:
        g, sink = PAGE_GROUP, self.pcfg.num_pages
        parts = self._page_parts()
        self._flush()
        for start in range(0, len(ckpt.pages), g):
            part = ckpt.pages[start:start + g]
            rows = np.full(g, sink, np.int32)
            rows[: len(part)] = part
            kv = [np.zeros((g, *shape), dtype) for shape, dtype in parts]
            for row, buffers in enumerate(image.pages[start:start + g]):
                raw = _bytes(buffers)  # the page's buffers, back to back in Pools.kv's order
                for a, (shape, dtype) in zip(kv, parts):
                    n = a[row].nbytes
                    a[row] = raw[:n].view(dtype).reshape(shape)
                    raw = raw[n:]
            self._pools = self.executables(StepKey(StepKind.IMPORT_PAGES, g), self._pools,
                                           PageImport(rows, *kv))
        raw, parts = _bytes([image.state]), []
        for pool in image_pools(self._pools):
            n = pool.nbytes // pool.shape[0]
            parts.append(raw[:n].view(pool.dtype).reshape(1, *pool.shape[1:]))
            raw = raw[n:]
        self._pools = self.executables(StepKey(StepKind.IMPORT_STATE, 1), self._pools,
                                       StateImport(np.array([ckpt.slot], np.int32), *parts))

    def _sampling(self, seqs: list[SeqRecord]):
        """The rows' SamplingArrays; the last ones again while the rows are the same sequences
        without token masks (a decode round after another: nothing in them changed)."""
        key = tuple(s.handle for s in seqs) if all(s.mask is None for s in seqs) else None
        if key is None or key != self._sampling_key:
            self._sampling_last = sampling_arrays(
                [s.sampling for s in seqs], [s.stop_ids for s in seqs], self.cfg.vocab_size,
                [s.mask for s in seqs], self.limits.mask_words)
            self._sampling_key = key
        return self._sampling_last

    def _page_table(self, seqs: list[SeqRecord]) -> np.ndarray:
        table = np.zeros((len(seqs), self.pcfg.max_pages_per_seq), np.int32)
        for row, seq in enumerate(seqs):
            table[row, : len(seq.pages)] = seq.pages
        return table


def _allocate(cfg: ModelConfig, pcfg: ProgramConfig, mtp_layers: int,
              drafter: DFlashConfig | None, mesh) -> Pools:
    """The zeroed pools; on a tensor-parallel mesh each made in place on its devices."""
    def make() -> Pools:
        return Pools.allocate(cfg, pcfg, mtp_layers, drafter)

    if mesh is None:
        return make()
    return jax.jit(make, out_shardings=pool_shardings(jax.eval_shape(make), cfg, mesh))()


def _check_drafter(cfg: ModelConfig, params: dict, pcfg: ProgramConfig,
                   drafter: DFlashConfig | None) -> None:
    """A DFlash Program needs a drafter that fits the target and K; others take none."""
    if pcfg.speculative != "dflash":
        if drafter is not None:
            raise ConfigError(f"a drafter is for speculative='dflash', not "
                              f"{pcfg.speculative!r}")
        return
    if drafter is None or "dflash" not in params:
        raise ConfigError("speculative='dflash' needs a DFlash drafter (its config and "
                          "params['dflash']); this model has none")
    drafter.check_target(cfg.num_layers, cfg.hidden_size, cfg.vocab_size)
    if pcfg.draft_head == "selector" and not drafter.has_selector:
        raise ConfigError("draft_head='selector' needs a drafter with a candidate selector "
                          "(selector_rank > 0); this one has none: use draft_head='full'")
    if pcfg.num_speculative_tokens > drafter.block_size - 1:
        raise ConfigError(
            f"num_speculative_tokens must be at most the drafter's block_size - 1 = "
            f"{drafter.block_size - 1}, got {pcfg.num_speculative_tokens}")


def _logprobs(seqs: list[SeqRecord], out) -> tuple | None:
    """The step's log-prob outputs when a row asked for them (else nothing is read back)."""
    if all(s.sampling.logprobs is None for s in seqs):
        return None
    return out.logprobs, out.top_ids, out.top_logprobs


def _bytes(buffers) -> np.ndarray:
    """The buffers' bytes, concatenated (one flat uint8 array)."""
    return np.concatenate([np.ascontiguousarray(b).reshape(-1).view(np.uint8) for b in buffers])
