"""transformers engine for small CPU runs and fast tests, with continuous batching. It computes on
the CPU, or on a cuda job on the server's GPU (where it stands in for vLLM when vLLM is absent:
the GPU check, bench/gpu_check.sh).

One scheduler task (asyncio, on the server's loop) owns the batch; each iteration runs in a
worker thread and does at most one decode forward for every request in flight (one new token
each) plus one left-padded prefill forward for the requests that arrived since the previous
iteration (they join the batch with their first token). Requests that finished or were aborted
leave between two iterations. So an abort, a pause or a weight load takes effect between two
tokens, and N concurrent requests cost about one forward per token instead of N. The padded KV
cache and why it was chosen over recomputation or transformers' own continuous-batching
manager: runtime/engines/hf_batch.py.

Each request keeps its own sampling (temperature, top_k, top_p, repetition penalty, seed,
max_tokens, stop strings and ids, EOS or ignore_eos), applied as vLLM applies them (penalty, then
temperature, top-k, top-p); a seeded request samples from its own generator with the same per-row
arithmetic whatever the batch holds, so it is reproducible. Log-probs are the log-softmax of the
raw logits. Concurrent /score requests are scored together in right-padded forwards, at most
max_num_seqs at a time. Weights load with `copy_` while
the scheduler is parked.

Vision-language models (Qwen-VL style: a config with a `vision_config`, loaded as its
`...ForConditionalGeneration` with its processor's image processor). A request's ids are the
processor-expanded ones (one image pad per merged patch) and its `images` the base64 files. Before
it queues, its images become `pixel_values` / `image_grid_thw` (the image processor, the same the
trainer's data path uses), its pad runs are checked against them (one run per image, as long as
the processor makes that image; else a one-line 400) and its M-RoPE positions are computed with
the trainer's own pure function (trainer.microbatch.mrope_positions, which the trainer checks
against the model's get_rope_index at start-up). Image requests then run in the same batch as
text requests, under the same scheduler, lock, pauses and per-request seeded sampler: a prefill
with images passes the joiners' pixels and [4, rows, width] position ids, and each row keeps its
rope delta, so its decode steps feed M-RoPE positions `length + delta` (hf_batch.py). Only the
forward inputs differ; a text row of such a model has delta 0 and plain positions. This was
chosen over running image requests one at a time outside the batch: the KV cache is position-
agnostic (RoPE is applied before keys are cached), so nothing but positions ties a row to its
images once it is prefilled, and image rows then get batching, abort, 'keep' and weight versions
exactly as text rows do. A /score with images runs in the right-padded scoring forward with its
pixels and M-RoPE positions. Images sent to a text-only model, and a resumed prefix holding the
image pad, are refused (400).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

import torch

from kubedistill.runtime.engines.base import BadRequest, Engine, InFlight, PauseMode
from kubedistill.runtime.engines.hf_batch import PaddedKVBatch, RowVision, score_batch
from kubedistill.runtime.engines.images import (
    check_image_runs,
    check_prefix,
    decode_images,
    image_pad_id,
    text_only,
    vision_token_ids,
)
from kubedistill.runtime.models.loading import auto_model_class, is_vision_language
from kubedistill.runtime.trainer.microbatch import VisionTokens, mrope_positions
from kubedistill.runtime.weight_sync.delta import Assembler
from kubedistill.runtime.weight_sync.delta import apply as apply_patch
from kubedistill.runtime.weight_sync.group import GroupAddress, WeightSyncGroup
from kubedistill.runtime.weight_sync.lora import BaseWeights, adapted_modules, merge, same_adapter_layout
from kubedistill.runtime.weight_sync.transfer import close_receive, receive
from kubedistill.runtime.wire.dtypes import dtype_name
from kubedistill.runtime.wire.protocol import (
    FinishReason,
    GenerateRequest,
    LoraAdapter,
    Manifest,
    ScoreRequest,
    ScoreResponse,
)
from kubedistill.runtime.wire.rows import Rows

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger("kubedistill.engines.hf")

DEFAULT_MAX_NUM_SEQS = 256
JOIN_WAIT_ITERATIONS = 4
"""Decode iterations a new request may wait for others to join a running batch with it."""
SCORE_LOGIT_BUDGET = 64 * 2**20
"""Logit elements (rows x padded length x vocabulary) one scoring forward may produce (256 MiB
fp32): bounds the memory of a batch of concurrent /score requests."""


@dataclass(eq=False)
class _Request:
    state: InFlight
    context: list[int]
    max_new: int
    temperature: float
    top_p: float
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    finished: asyncio.Future[FinishReason]
    top_k_ids: int = 0
    top_k: int = 0  # 0: every token
    repetition_penalty: float = 1.0
    stop_texts: tuple[str, ...] = ()
    vision: RowVision | None = None  # the prompt's images (a vision-language model)
    reason: FinishReason | Literal["error"] | None = None  # set when it leaves the batch

    def finish(self, reason: FinishReason) -> None:
        self.reason = reason
        if not self.finished.done():
            self.finished.set_result(reason)

    def fail(self, error: BaseException) -> None:
        self.reason = "error"
        if not self.finished.done():
            self.finished.set_exception(error)


@dataclass(eq=False)
class _Score:
    req: ScoreRequest
    done: asyncio.Future[ScoreResponse]
    vision: RowVision | None = None


@dataclass
class _StepResult:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk_ids: list[list[int] | None] = field(default_factory=list)
    scores: list[ScoreResponse | Exception] = field(default_factory=list)


class HFEngine(Engine):
    name = "hf"

    def __init__(
        self,
        model_path: str,
        dtype: str = "auto",
        max_model_len: int | None = None,
        trust_remote_code: bool = False,
        max_num_seqs: int | None = None,
        device: str = "cpu",
        tokenizer: str | None = None,
    ) -> None:
        super().__init__()
        self.model_path = model_path
        self.tokenizer_path = tokenizer or model_path
        """The tokenizer (model.tokenizer, else the model's directory): it decodes responses for
        stop strings and names a vision-language model's image pad when its config does not."""
        self._tokenizer: Any = None  # loaded by the first request with stop strings
        self.dtype = dtype
        self.device = torch.device(device)
        """Where the model computes: the CPU, or this process's GPU on a cuda job (a torch device)."""
        self._max_model_len = max_model_len  # the model's own limit caps it at start()
        self.trust_remote_code = trust_remote_code
        self.max_num_seqs = max_num_seqs or DEFAULT_MAX_NUM_SEQS
        self.model: PreTrainedModel | None = None  # loaded by start()
        self._params: dict[str, torch.Tensor] = {}
        """The model's own parameters under their HF names (kept when PEFT wraps the layers)."""
        # LoRA versions (runtime/weight_sync/lora.py): how they are served once the first one
        # arrived, the base weights merges start from, and, serving adapters, PEFT's adapter
        # parameters under their wire names with the (rank, modules) they were made for.
        self._lora_mode: Literal["merged", "adapter"] | None = None
        self._lora_base: BaseWeights | None = None
        self._adapter_params: dict[str, torch.Tensor] = {}
        self._adapter_layout: tuple[int, frozenset[str]] | None = None
        self._eos: frozenset[int] = frozenset()
        self._vocab_size: int | None = None
        # A vision-language model's image pad and merge, and its image processor (None: text).
        self._vision: VisionTokens | None = None
        self._never_sampled: list[int] = []  # a vision-language model's placeholder ids: never sampled
        self._image_processor: Any = None
        self._lock = threading.Lock()  # forwards vs weight copies and checksums
        self._rows: list[_Request] = []  # aligned with the batch's rows (finished ones until compacted)
        self._batch: PaddedKVBatch | None = None
        self._queue: list[_Request] = []  # waiting to join
        self._join_wait = 0  # iterations the queue has waited to join a running batch
        self._scores: list[_Score] = []
        self._pause: PauseMode | None = None
        self._task: asyncio.Task[None] | None = None
        self._forwards: cf.ThreadPoolExecutor | None = None  # made by start()
        # The scheduler's loop and its events; _ensure_scheduler makes new ones for each event loop.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()
        self._parked = asyncio.Event()
        self.forwards = {"decode": 0, "prefill": 0, "score": 0}  # forwards run, by kind
        self.decoded_rows = 0  # rows over all decode forwards (/ forwards["decode"] = mean batch)

    async def start(self) -> None:
        # Every forward runs on this one thread: asyncio.to_thread would spread the iterations
        # over the default executor's threads, and hopping between threads slows every iteration
        # down (figures in docs/servers.md, "The hf engine").
        self._forwards = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-engine")
        await asyncio.to_thread(self._load)
        self._ensure_scheduler()

    def _load(self) -> None:
        from transformers import AutoConfig

        dtype = "auto" if self.dtype == "auto" else getattr(torch, self.dtype)
        config = AutoConfig.from_pretrained(self.model_path, trust_remote_code=self.trust_remote_code)
        # A vision-language model loads as its ...ForConditionalGeneration (tower + LM + head).
        cls = auto_model_class(config)
        model = cls.from_pretrained(self.model_path, dtype=dtype, trust_remote_code=self.trust_remote_code)
        model = model.to(self.device).eval()
        self.model = model
        self._load_vision(model)
        limit = getattr(model.config.get_text_config(), "max_position_embeddings", None) or 2048
        self._max_model_len = min(self._max_model_len or limit, limit)
        self._params = dict(model.named_parameters())
        self._lora_mode, self._lora_base, self._adapter_params, self._adapter_layout = None, None, {}, None
        self._eos = frozenset(self._eos_ids())
        # Read once: every request is checked against it, and the config's attribute lookups
        # are not free on the server's event loop (docs/design.md, "Smaller measurements").
        self._vocab_size = int(model.config.get_text_config().vocab_size)

    def _load_vision(self, model: PreTrainedModel) -> None:
        """A vision-language model's image pad, spatial merge and image processor (its
        AutoProcessor's, saved beside it); nothing for a causal LM."""
        self._vision, self._image_processor = None, None
        self._never_sampled = []
        if not is_vision_language(model.config):
            return
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(self.model_path, trust_remote_code=self.trust_remote_code)
        self._image_processor = processor.image_processor
        self._vision = VisionTokens(
            image_token_id=image_pad_id(model.config, self.tokenizer_path),
            merge=int(model.config.vision_config.spatial_merge_size),
        )
        self._never_sampled = vision_token_ids(model.config)

    async def _images_of(self, ids: Sequence[int], images: Sequence[str] | None, field_name: str) -> RowVision | None:
        """_row_vision, in a worker thread when there are images to decode and process."""
        if not images:
            return self._row_vision(ids, images, field_name)  # checks only: no pixels
        return await asyncio.to_thread(self._row_vision, ids, images, field_name)

    def _row_vision(self, ids: Sequence[int], images: Sequence[str] | None, field_name: str) -> RowVision | None:
        """A request's images as the model takes them, checked against its (processor-expanded)
        ids: one run of image pads per image, each as long as the processor makes that image
        (400, one line, otherwise; also for images sent to a text-only model). None without images."""
        if self._vision is None:
            if images:
                raise text_only()
            return None
        runs = check_image_runs(ids, self._vision.image_token_id, len(images or []), field_name)
        if not images:
            return None
        enc = self._image_processor(images=decode_images(images), return_tensors="pt")
        grid = enc["image_grid_thw"]
        sizes = self._vision.tokens_per_image(grid).tolist()
        for i, ((_, length), size) in enumerate(zip(runs, sizes)):
            if length != size:
                raise BadRequest(
                    f"{field_name}: image {i} has {length} pad tokens, the model's processor makes {size} of it; "
                    "expand the ids with the student's processor"
                )
        positions = mrope_positions(torch.tensor(list(ids), dtype=torch.long), grid, self._vision)
        return RowVision(positions=positions, pixel_values=enc["pixel_values"], grid_thw=grid)

    async def shutdown(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        error = RuntimeError("the engine shut down")
        for r in self._rows + self._queue:
            r.fail(error)
        for s in self._scores:
            if not s.done.done():
                s.done.set_exception(error)
        self._rows, self._queue, self._scores, self._batch, self._task = [], [], [], None, None
        if self._forwards is not None:
            self._forwards.shutdown(wait=False)
            self._forwards = None
        self.model = None
        self._vocab_size = None

    @property
    def max_model_len(self) -> int:
        if self._max_model_len is None:
            raise RuntimeError("the hf engine is not started: max_model_len comes from the model's config")
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        if self._vocab_size is None:
            raise RuntimeError("the hf engine is not started: vocab_size comes from the model's config")
        return self._vocab_size

    def weight_dtype(self) -> str | None:
        if self.model is None:
            return None
        dtypes = {p.dtype for p in self._params.values()}  # the model's own (not PEFT's adapter layers)
        return dtype_name(dtypes.pop()) if len(dtypes) == 1 else None

    def serves_at_load(self) -> bool:
        return True  # _receive_sync: loaded() before close_receive()

    def receives_in_place(self) -> bool:
        return True  # receive()'s destination: the parameter itself, generation being paused

    @property
    def _model(self) -> PreTrainedModel:
        if self.model is None:
            raise RuntimeError("the hf engine is not started (or was shut down)")
        return self.model

    def _eos_ids(self) -> set[int]:
        eos = self._model.generation_config.eos_token_id
        if eos is None:
            eos = self._model.config.eos_token_id
        return set(eos if isinstance(eos, list) else [] if eos is None else [eos])

    # --- the scheduler ----------------------------------------------------------------------
    def _ensure_scheduler(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is not None and not self._task.done() and self._loop is loop:
            return
        # First use, a new event loop (tests), or a crashed scheduler: nothing left can finish.
        error = RuntimeError("the hf engine's scheduler stopped")
        for r in self._rows + self._queue:
            if not r.finished.get_loop().is_closed():
                r.fail(error)
        self._rows, self._queue, self._scores, self._batch = [], [], [], None
        self._loop, self._wake, self._parked = loop, asyncio.Event(), asyncio.Event()
        self._task = loop.create_task(self._run(), name="hf-engine-scheduler")
        self._task.add_done_callback(_log_crash)

    async def _run(self) -> None:
        while True:
            self._retire()
            active = [r for r in self._rows if r.reason is None]
            if self._pause is not None and (self._pause == "keep" or not active):
                # 'keep' freezes the batch (KV cache included) right here; 'wait' and 'abort'
                # get here once no request is left running. New requests queue meanwhile.
                self._parked.set()
                await self._idle()
                continue
            joiners = self._admit(len(active))
            scores, self._scores = self._scores, []
            if not (active or joiners or scores):
                await self._idle()
                continue
            keep = [i for i, r in enumerate(self._rows) if r.reason is None]
            version = self.version
            try:
                result = await asyncio.get_running_loop().run_in_executor(
                    self._forwards, self._iteration, keep, active + joiners, len(joiners), scores
                )
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # the batch is unusable: fail its requests, keep serving
                log.exception("hf engine forward failed")
                for r in active + joiners:
                    r.fail(e)
                self._rows, self._batch = [], None
                for s in scores:
                    if not s.done.done():
                        s.done.set_exception(e)
                continue
            self._rows = active + joiners
            for r, token, logprob, topk in zip(self._rows, result.tokens, result.logprobs, result.topk_ids):
                st = r.state
                st.token_ids.append(token)
                st.logprobs.append(logprob)
                st.versions.append(version)
                if topk is not None:
                    if st.topk_ids is None:
                        st.topk_ids = []
                    st.topk_ids.append(topk)
                if token in r.stop_ids or (r.stop_texts and self._stop_text_hit(r)):
                    r.finish("stop")
                elif len(st.token_ids) >= r.max_new:
                    r.finish("length")
            for s, out in zip(scores, result.scores):
                if s.done.done():
                    continue
                if isinstance(out, BaseException):
                    s.done.set_exception(out)
                else:
                    s.done.set_result(out)

    def _stop_text_hit(self, r: _Request) -> bool:
        """Whether the token just generated completes one of the request's stop strings, on the
        text of its generated tokens (as vLLM matches them). Only the tail is decoded: a string of
        L characters lies within the last 4L tokens (a byte-level token holds at least a quarter
        of a character)."""
        window = 4 * max(len(s) for s in r.stop_texts) + 4
        text = self._tokenizer.decode(r.state.token_ids[-window:], skip_special_tokens=True)
        return any(s in text for s in r.stop_texts)

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.tokenizer_path, trust_remote_code=self.trust_remote_code)

    async def _idle(self) -> None:
        self._wake.clear()
        await self._wake.wait()

    def _retire(self) -> None:
        for r in self._rows:
            if r.reason is None and r.state.aborted:
                r.finish("abort")
        still = []
        for r in self._queue:
            if r.state.aborted:
                r.finish("abort")
            else:
                still.append(r)
        self._queue = still

    def _admit(self, running: int) -> list[_Request]:
        """Requests that join the batch at this iteration. Each join costs a prefill forward of its
        own beside the decode step (plus a copy of the cache to add the rows), so while a batch
        is running, arrivals are let in together: once they make up a quarter of it, or after
        JOIN_WAIT_ITERATIONS iterations of waiting."""
        if self._pause is not None or not self._queue:
            return []
        room = max(self.max_num_seqs - running, 0)
        if running and len(self._queue) < min(room, max(1, running // 4)) and self._join_wait < JOIN_WAIT_ITERATIONS:
            self._join_wait += 1
            return []
        self._join_wait = 0
        joiners, self._queue = self._queue[:room], self._queue[room:]
        return joiners

    def _iteration(self, keep: list[int], rows: list[_Request], joining: int, scores: list[_Score]) -> _StepResult:
        """One decode step for the rows in the batch, one prefill for the joiners, then sampling
        for all of them; plus the pending /score requests. Runs in a worker thread."""
        result = _StepResult()
        with self._lock, torch.no_grad():
            model = self._model
            if self._batch is not None and len(keep) != self._batch.rows:
                self._batch = self._batch.select(keep)
            logits: list[torch.Tensor] = []
            if self._batch is not None:
                logits.append(self._batch.step(model))
                self.forwards["decode"] += 1
                self.decoded_rows += self._batch.rows
            joined: PaddedKVBatch | None = None
            if joining:
                joiners = rows[-joining:]
                vision = [r.vision for r in joiners] if self._vision is not None else None
                joined, first = PaddedKVBatch.prefill(model, [r.context for r in joiners], vision)
                logits.append(first)
                self.forwards["prefill"] += 1
            if logits:
                all_logits = torch.cat(logits).float()
                tokens = sample_rows(never_sampled(all_logits, self._never_sampled), rows)
                result.tokens = tokens.tolist()
                tokens = tokens.to(all_logits.device)
                all_lp = torch.log_softmax(all_logits, -1)
                result.logprobs = all_lp.gather(1, tokens[:, None])[:, 0].tolist()
                result.topk_ids = top_k_rows(all_lp, [r.top_k_ids for r in rows])
                if self._batch is not None:
                    self._batch.last = tokens[: self._batch.rows]
                if joined is not None:
                    joined.last = tokens[len(rows) - joining :]
                    self._batch = joined if self._batch is None else self._batch.extend(joined)
            result.scores = self._score_all(scores) if scores else []
        return result

    # --- generation -------------------------------------------------------------------------
    async def _generate(self, req: GenerateRequest, max_new: int, state: InFlight) -> FinishReason:
        self._ensure_scheduler()
        s = req.sampling
        context = list(req.prompt_token_ids) + list(req.prefix_token_ids)
        if self._vision is not None:
            check_prefix(req.prefix_token_ids, self._vision.image_token_id)
        # The prefix follows the prompt's images: its positions continue as text.
        vision = await self._images_of(context, req.images, "prompt_token_ids")
        if s.stop and self._tokenizer is None:
            self._tokenizer = await asyncio.to_thread(self._load_tokenizer)
        r = _Request(
            state=state,
            context=context,
            vision=vision,
            max_new=max_new,
            temperature=s.temperature,
            top_p=s.top_p,
            generator=torch.Generator().manual_seed(s.seed) if s.seed is not None else None,
            # vLLM's: ignore_eos ignores EOS only, the stop ids still end the response.
            stop_ids=(frozenset() if s.ignore_eos else self._eos) | frozenset(s.stop_token_ids),
            finished=asyncio.get_running_loop().create_future(),
            top_k_ids=s.top_k_ids,
            top_k=s.top_k,
            repetition_penalty=s.repetition_penalty,
            stop_texts=tuple(s.stop),
        )
        self._queue.append(r)
        self._wake.set()
        try:
            return await r.finished
        except asyncio.CancelledError:
            state.aborted = True  # the caller went away: free the row at the next step
            self._wake.set()
            raise

    async def _abort(self, request_ids: list[str]) -> None:
        self._wake.set()  # the scheduler retires aborted requests before its next step

    # --- scoring ----------------------------------------------------------------------------
    async def _score(self, req: ScoreRequest) -> ScoreResponse:
        self._ensure_scheduler()
        vision = await self._images_of(req.token_ids, req.images, "token_ids")
        job = _Score(req, asyncio.get_running_loop().create_future(), vision)
        self._scores.append(job)
        self._wake.set()
        return await job.done

    def _score_all(self, jobs: list[_Score]) -> list[ScoreResponse | Exception]:
        """Score the requests in as few right-padded forwards as SCORE_LOGIT_BUDGET allows (image
        samples among them, with their pixels and M-RoPE positions); a failed forward yields its
        exception for each of its requests."""
        vocab = self.vocab_size
        out: list[ScoreResponse | Exception] = []
        chunk: list[_Score] = []

        def flush() -> None:
            if not chunk:
                return
            try:
                vision = [j.vision for j in chunk] if self._vision is not None else None
                lps = score_batch(self._model, [j.req.token_ids for j in chunk], vision)
                self.forwards["score"] += 1
                out.extend(_score_response(j.req, lp) for j, lp in zip(chunk, lps))
            except Exception as e:
                out.extend([e] * len(chunk))
            chunk.clear()

        for j in jobs:
            width = max([len(c.req.token_ids) for c in chunk] + [len(j.req.token_ids)])
            if len(chunk) >= self.max_num_seqs or (chunk and (len(chunk) + 1) * width * vocab > SCORE_LOGIT_BUDGET):
                flush()
            chunk.append(j)
        flush()
        return out

    # --- weights ----------------------------------------------------------------------------
    def expected_tensors(self) -> Mapping[str, Sequence[int]]:
        if self.model is None:
            raise RuntimeError("the hf engine is not started (or was shut down)")
        return {n: list(p.shape) for n, p in self._params.items()}

    def check_manifest(self, manifest: Manifest) -> None:
        """Beyond the shapes: once LoRA versions arrived, the next ones must be served the same
        way (a merged delta and an unmerged adapter would otherwise both apply), and an adapter
        must fit the adapter layers PEFT made for the first one."""
        super().check_manifest(manifest)
        lora = manifest.lora
        if self._lora_mode == "adapter":
            if lora is None or lora.serve_as != "adapter":
                what = "full weights" if lora is None else "a LoRA adapter to merge"
                raise ValueError(f"manifest mismatch: this engine serves LoRA adapters unmerged; it cannot load {what}")
            assert self._adapter_layout is not None
            why = same_adapter_layout(lora, adapted_modules(t.name for t in manifest.tensors), self._adapter_layout)
            if why is not None:
                raise ValueError(f"manifest mismatch: the LoRA adapter does not fit the one served: {why}")
        elif self._lora_mode == "merged" and lora is not None and lora.serve_as == "adapter":
            raise ValueError("manifest mismatch: this engine merges LoRA versions; it cannot switch to adapters")

    async def weight_checksums(self) -> dict[str, str]:
        from kubedistill.runtime.weight_sync.manifest import tensor_checksum

        def run() -> dict[str, str]:
            with self._lock:
                model = self._model
                # The model's own weights (merged LoRA versions included); an adapter served
                # unmerged is not in them.
                out = {n: tensor_checksum(p) for n, p in self._params.items()}
                head = model.get_output_embeddings()
                out["lm_head.weight"] = tensor_checksum(getattr(head, "base_layer", head).weight)
            return out

        return await asyncio.to_thread(run)

    async def join_weight_group(self, addr: GroupAddress) -> None:
        self.weight_group_state = "joining"
        try:
            self.group = await asyncio.to_thread(WeightSyncGroup, member_address(addr, self.device))
        except Exception:
            self.weight_group_state = "failed"
            raise
        self.weight_group_state = "ready"

    async def receive_weights(self, manifest: Manifest, version: int, pause: PauseMode, load: bool) -> dict[str, float]:
        group = self.group
        if group is None:
            raise RuntimeError("not in the weight-sync group")
        t0 = time.perf_counter()
        try:
            await self._pause_generation(pause, group.addr.timeout_seconds)
            stats = await asyncio.to_thread(self._receive_sync, group, manifest, version, load)
        finally:
            self._resume_generation()
        stats["seconds"] = time.perf_counter() - t0
        return stats

    async def _pause_generation(self, mode: PauseMode, timeout: float) -> None:
        """Return once the scheduler is parked, so no forward can mix old and new weights:
        'wait' lets the running requests finish, 'abort' ends them at their next token, 'keep'
        freezes them before their next token. New requests queue until the load is done."""
        self._ensure_scheduler()
        self._parked.clear()
        self._pause = mode
        if mode == "abort":
            for s in self.inflight.values():
                s.aborted = True
        self._wake.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._parked.wait()), timeout)
        except TimeoutError:
            # The trainer is already blocked in the broadcast: freeze what still runs instead.
            log.warning("requests still running after %.0f s of 'wait': freezing them for the weight load", timeout)
            self._pause = "keep"
            self._wake.set()
            await self._parked.wait()

    def _resume_generation(self) -> None:
        self._pause = None
        self._wake.set()

    def _receive_sync(self, group: WeightSyncGroup, manifest: Manifest, version: int, load: bool) -> dict[str, float]:
        errors: list[str] = []
        lora = manifest.lora
        adapter: dict[str, torch.Tensor] = {}  # a LoRA version's tensors, applied once all arrived
        # A delta's pieces patch the parameters in place: they hold the base bit for bit.
        delta = manifest.delta
        patches = Assembler(delta.targets) if delta is not None and delta.base is not None else None

        def consume(named: list[tuple[str, torch.Tensor]]) -> None:
            if errors or not load:
                return
            try:
                if lora is not None:
                    adapter.update((n, t.clone()) for n, t in named)  # the views die with their bucket
                    return
                with self._lock:
                    for name, t in named:
                        if patches is None:
                            self._params[name].data.copy_(t)
                            continue
                        for target, positions, values in patches.add(name, t):
                            apply_patch(self._params[target].data, positions, values)
            except Exception as e:  # keep receiving so the collective stays in step
                errors.append(f"{type(e).__name__}: {e}")

        def destination(name: str) -> torch.Tensor | None:
            # Generation is parked: the broadcast may land in the parameter itself.
            p = self._params.get(name) if lora is None else None
            return p.data if (load and not errors and p is not None) else None

        with torch.no_grad():
            stats = receive(group, manifest, consume, destination)
            t_apply = time.perf_counter()
            if patches is not None and load and not errors:
                try:
                    patches.check_done()
                except ValueError as e:
                    errors.append(str(e))
            if lora is not None and load and not errors:
                try:
                    self._apply_lora(lora, adapter)
                except Exception as e:  # reported through the all-reduce, like a failed load
                    errors.append(f"{type(e).__name__}: {e}")
            stats.consume_seconds += time.perf_counter() - t_apply
        if load and not errors:
            # Before the all-reduce that releases the trainer: once its sync returns, /version
            # must already report the new version.
            self.loaded(version, manifest)
        return close_receive(group, stats, errors, load)

    def _apply_lora(self, lora: LoraAdapter, tensors: dict[str, torch.Tensor]) -> None:
        """Serve a received LoRA version: merged, each adapted weight becomes W0 + scale * B @ A
        (W0 from the checkpoint: lora.BaseWeights); as an adapter, the tensors go into the PEFT
        LoRA layers made on the first one, and generation runs them unmerged."""
        with torch.no_grad():  # the parameters (and PEFT's) require grad
            modules = adapted_modules(tensors)
            if lora.serve_as == "adapter":
                if self._lora_mode is None:
                    self._wrap_lora(lora, list(modules))
                with self._lock:
                    for name, t in tensors.items():
                        self._adapter_params[name].copy_(t)
                self._lora_mode = "adapter"
                return
            if self._lora_base is None:
                # The fallback snapshots a parameter no merge has written yet: still the base one.
                self._lora_base = BaseWeights(self.model_path, fallback=lambda n: self._params[n].detach().clone())
            base = self._lora_base.get(m.weight for m in modules.values())
            with self._lock:
                for m in modules.values():
                    p = self._params[m.weight]
                    p.copy_(merge(base[m.weight], tensors[m.a], tensors[m.b], lora.scale, p.dtype))
            self._lora_mode = "merged"

    def _wrap_lora(self, lora: LoraAdapter, modules: list[str]) -> None:
        """Put PEFT LoRA layers (dropout 0) on exactly the adapted modules, in place: the model's
        own parameters stay the same tensors (now the layers' base_layer), so self._params and
        the batches' forwards are unchanged."""
        from peft import LoraConfig, inject_adapter_in_model
        from peft.tuners.lora import LoraLayer

        # lora_alpha is a placeholder: each layer's scaling is set to the trainer's below.
        config = LoraConfig(r=lora.rank, lora_alpha=lora.rank, target_modules=modules, lora_dropout=0.0)
        with self._lock:
            model = inject_adapter_in_model(config, self._model)
            for module in model.modules():
                if isinstance(module, LoraLayer):
                    # Exactly the trainer's scale (alpha / rank, or rsLoRA's), not recomputed.
                    module.scaling["default"] = lora.scale
            self._adapter_params = {
                name.replace(".default.", "."): p for name, p in model.named_parameters() if ".lora_" in name
            }
            self._adapter_layout = (lora.rank, frozenset(modules))


def member_address(addr: GroupAddress, device: torch.device) -> GroupAddress:
    """This engine's place in the weight-sync group: on NCCL the buckets land on the model's own
    GPU (so the broadcast fills the parameters in place), on gloo in host memory."""
    if addr.backend != "nccl":
        return addr
    if device.type != "cuda":
        raise ValueError(f"an NCCL weight sync needs the hf engine on a GPU; it runs on {device}")
    return replace(addr, device=str(device if device.index is not None else torch.device("cuda", 0)))


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the hf engine's scheduler stopped", exc_info=task.exception())


def _score_response(req: ScoreRequest, lp: torch.Tensor) -> ScoreResponse:
    # Position t's token is predicted by the log-probs at t - 1.
    lp = lp[req.prompt_len - 1 : -1]
    targets = torch.tensor(req.token_ids[req.prompt_len :], dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, targets[:, None])[:, 0]
    top = lp.topk(req.top_k, dim=-1)  # k 0: [T, 0], whose lists are the empty rows asked for
    gathered = None
    if req.gather_ids is not None:  # padded rows gather id 0, then left out by their lengths
        index = torch.tensor(req.gather_ids.array(), dtype=torch.long, device=lp.device)
        gathered = Rows.of(lp.gather(1, index).float().cpu().numpy(), "float32", req.gather_ids.lengths)
    return ScoreResponse(
        logprobs=chosen.tolist(),
        topk_ids=Rows.of(top.indices.to(torch.int32).cpu().numpy(), "int32"),
        topk_logprobs=Rows.of(top.values.float().cpu().numpy(), "float32"),
        gather_logprobs=gathered,
    )


def top_k_rows(logprobs: torch.Tensor, ks: Sequence[int]) -> list[list[int] | None]:
    """Each row's `ks[i]` most likely ids, best first (None where 0: the request asked for none)."""
    widest = max(ks, default=0)
    if widest == 0:
        return [None] * len(ks)
    top = logprobs.topk(widest, dim=-1).indices.tolist()
    return [row[:k] if k else None for row, k in zip(top, ks)]


def never_sampled(logits: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
    """`logits` with `ids` (a vision-language model's placeholder tokens) made unsampleable, as
    vLLM's logit bias does; the log-probs the engine reports stay the unmasked ones."""
    if not ids:
        return logits
    return logits.index_fill(-1, torch.tensor(list(ids), device=logits.device), float("-inf"))


def penalized(logits: torch.Tensor, rows: Sequence[_Request]) -> torch.Tensor:
    """`logits` with each row's repetition penalty applied to the ids in its prompt and response
    (positive logits divided by it, negative ones multiplied), as vLLM and transformers do."""
    out = logits
    for i, r in enumerate(rows):
        if r.repetition_penalty == 1.0:
            continue
        if out is logits:
            out = logits.clone()
        seen = torch.tensor(sorted({*r.context, *r.state.token_ids}), dtype=torch.long, device=logits.device)
        chosen = out[i, seen]
        out[i, seen] = torch.where(chosen > 0, chosen / r.repetition_penalty, chosen * r.repetition_penalty)
    return out


def sample_rows(logits: torch.Tensor, rows: Sequence[_Request]) -> torch.Tensor:
    """One token per row of float logits [rows, vocab] with each row's own sampling: greedy rows
    take the argmax; the others' tempered, top-k and top-p filtered distributions are made in one
    batched pass, unseeded rows drawn together from the global generator, each seeded row by one
    uniform from its own generator through the inverse CDF (row by row, softmax and multinomial
    were a third of the quickstart's rollout server: 64 seeded rows a token)."""
    logits = penalized(logits, rows)
    tokens = logits.argmax(-1).cpu()
    drawn = [i for i, r in enumerate(rows) if r.temperature > 0.0]
    if not drawn:
        return tokens
    probs = _distributions(logits, [rows[i] for i in drawn], drawn)
    picks = torch.empty(len(drawn), dtype=torch.long)
    free = [j for j, i in enumerate(drawn) if rows[i].generator is None]
    if free:
        picks[free] = torch.multinomial(probs[free], 1)[:, 0].cpu()
    seeded = [j for j, i in enumerate(drawn) if rows[i].generator is not None]
    if seeded:
        u = torch.cat([torch.rand(1, generator=rows[drawn[j]].generator) for j in seeded]).to(probs.device)
        picks[seeded] = inverse_cdf(probs[seeded], u).cpu()
    tokens[drawn] = picks
    return tokens


def _distributions(logits: torch.Tensor, rows: Sequence[_Request], index: Sequence[int]) -> torch.Tensor:
    """The sampling distributions of `rows` (logits' rows `index`): softmax at each row's
    temperature, then its top-k, then its top-p."""
    idx = torch.tensor(index, dtype=torch.long, device=logits.device)
    temps = torch.tensor([r.temperature for r in rows], device=logits.device)[:, None]
    probs = torch.softmax(logits.index_select(0, idx) / temps, -1)
    if any(r.top_k for r in rows):
        probs = _top_k(probs, torch.tensor([r.top_k for r in rows], device=logits.device)[:, None])
    if any(r.top_p < 1.0 for r in rows):
        # Sorting every row's whole vocabulary is a large share of a decode step (docs/design.md,
        # "Servers against their engines"); top_p 1 keeps every token anyway.
        probs = _top_p(probs, torch.tensor([r.top_p for r in rows], device=logits.device)[:, None])
    return probs


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of `probs` [rows, vocab], the token whose cumulative mass first exceeds u [rows]
    (uniform in [0, 1)) times the row's total: an exact draw, never a zero-probability token."""
    cdf = probs.cumsum(-1)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return picked.clamp(max=probs.shape[-1] - 1)


def _top_k(probs: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k most likely tokens (k [rows, 1]; 0 keeps every token), renormalised so
    that top-p then reads the top-k distribution's mass."""
    vocab = probs.shape[-1]
    k = k.clamp(max=vocab)
    kth = probs.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1).clamp(min=0))
    kept = probs * ((probs >= kth) | (k == 0))
    return kept / kept.sum(-1, keepdim=True)


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (per row)."""
    sorted_p, order = probs.sort(-1, descending=True)
    keep = sorted_p.cumsum(-1) - sorted_p < top_p
    return torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
