"""The computations of the scoring and training model-stages, as jittable functions of plain trees.

Sequences follow :mod:`nereus_jax.rl.batch` (prompt left-padded to P, response right-padded to R).
Training runs one SPMD program over the stage's DP replicas. One update (:func:`make_train_step`) takes
``[accum, rows, ...]`` micro-batches (rows split over ``dp``), sums gradients over them with ``lax.scan``,
and normalises every loss by the WHOLE (mini-)batch's token / sequence counts, so the result does not
depend on how the batch is split across replicas or micro-batches (up to float reduction order).
A rollout batch's updates (:func:`make_minibatch_train_step`) are one program too: ``ppo_epochs`` passes
over ``[mini_batches, accum, rows, ...]``, an optimizer update per mini-batch, all in one dispatch (a scan
compiles its body once, so the program does not grow with mini_batches x epochs).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from nereus_jax.config import AlgorithmConfig, ModelConfig
from nereus_jax.models import forward
from nereus_jax.models.lora import dropout_keys, join, row_keys, split_trainable
from nereus_jax.models.routing import NO_ROUTE, RouterStats, load_balancing_loss
from nereus_jax.models.vocab import DEFAULT_VOCAB_CHUNK, head_logprobs
from nereus_jax.rl import packing
from nereus_jax.rl.algorithms import (
    aggregate,
    kl_estimate,
    masked_mean,
    policy_loss,
    settings,
    value_loss,
)
from nereus_jax.sharding import pipeline as pipe
from nereus_jax.sharding import stored_kv_repeat, sync_kv_grads

LossFn = Callable[[dict, dict], tuple[jax.Array, dict]]
ForwardFn = Callable[..., jax.Array]  # forward()'s signature; a pipelined forward for pp > 1
GradFn = Callable[[dict, dict], tuple[tuple[jax.Array, dict], dict]]  # jax.value_and_grad(loss, has_aux=True)
MakeLoss = Callable[[ForwardFn], LossFn]  # e.g. functools.partial(actor_loss, cfg, algo, prompt_len)


def response_logits(params, cfg: ModelConfig, tokens_bl, mask_bl, prompt_len: int,
                    forward_fn: ForwardFn = forward) -> jax.Array:
    """Logits predicting each response token, [b, R, vocab]."""
    return forward_fn(params, cfg, tokens_bl, None, mask_bl)[:, prompt_len - 1: -1]


def response_logprobs(params, cfg: ModelConfig, tokens_bl, mask_bl, prompt_len: int,
                      forward_fn: ForwardFn = forward, *, vocab_chunk: int = DEFAULT_VOCAB_CHUNK) -> jax.Array:
    """log p(response token t | everything before it), [b, R] (the actor-infer and ref-infer output)."""
    mb = {"tokens": tokens_bl, "mask": mask_bl}
    return response_stats(params, cfg, mb, prompt_len, forward_fn, vocab_chunk=vocab_chunk)[0]


def response_values(params, cfg: ModelConfig, tokens_bl, mask_bl, prompt_len: int,
                    forward_fn: ForwardFn = forward) -> jax.Array:
    """Value of the state before each response token, [b, R] (the critic-infer output)."""
    return forward_fn(params, cfg, tokens_bl, None, mask_bl)[:, prompt_len - 1: -1, 0]


def sequence_scores(params, cfg: ModelConfig, tokens_bl, mask_bl, forward_fn: ForwardFn = forward) -> jax.Array:
    """A reward model's score at each row's last real token, [b] (the prompt may be left-padded: the last
    column whose mask is 1, as Hugging Face's sequence classifiers pick it)."""
    values = forward_fn(params, cfg, tokens_bl, None, mask_bl)[..., 0]
    last = jnp.max(jnp.where(mask_bl > 0, jnp.arange(mask_bl.shape[1]), 0), axis=1)
    return jnp.take_along_axis(values, last[:, None], axis=1)[:, 0]


def response_stats(params, cfg: ModelConfig, mb: dict, prompt_len: int, forward_fn: ForwardFn = forward, *,
                   entropy: bool = False, vocab_chunk: int = DEFAULT_VOCAB_CHUNK, replay: bool = False,
                   routing: bool = False):
    """Each response token's log-prob [b, R] (and entropy [b, R] with ``entropy``) from a micro-batch, padded
    (``tokens`` / ``mask`` [b, P + R]) or packed (:func:`split_packed`), in the padded batch's layout. The
    output head runs over ``vocab_chunk``-wide vocabulary chunks (:func:`~nereus_jax.models.vocab.head_logprobs`;
    0: the whole logits tensor at once), so no call holds ``tokens x vocab`` logits or their gradient.

    Mixture-of-experts models: with ``replay`` the forward routes every token the micro-batch's recorded routes
    (``routes`` [b, P + R, layers, k], or packed ``packed_routes``) cover to those experts; ``routing`` returns
    ``(logp, entropy, RouterStats)``, whose mismatches (given routes) are per response token, [b, R]."""
    stats = functools.partial(head_logprobs, params, vocab_chunk=vocab_chunk, entropy=entropy)
    extra = _routing_kwargs(mb, replay, routing) | _dropout_kwargs(mb)
    if "packed_tokens" not in mb:
        out = forward_fn(params, cfg, mb["tokens"], None, mb["mask"], return_hidden=True, **extra)
        hidden, router = out if routing else (out, None)
        logp, ent = stats(hidden[:, prompt_len - 1: -1], mb["tokens"][:, prompt_len:])
        if routing and router.mismatch_bt is not None:  # the response tokens' columns
            router = router._replace(mismatch_bt=router.mismatch_bt[:, prompt_len:],
                                     own_mismatch_bt=router.own_mismatch_bt[:, prompt_len:])
        return (logp, ent, router) if routing else (logp, ent)
    out = _packed_forward(params, cfg, mb, forward_fn, return_hidden=True, **extra)  # [dp, rows * L, embed]
    hidden, router = out if routing else (out, None)
    # the output at each column predicts the next column's token (a row's last column is never gathered)
    logp, ent = stats(hidden, jnp.roll(mb["packed_tokens"], -1, axis=-1).reshape(hidden.shape[:2]))
    logp, ent = _unpack(logp, mb["unpack_index"]), _unpack(ent, mb["unpack_index"]) if entropy else None
    if not routing:
        return logp, ent
    if router.mismatch_bt is not None:  # response token t sits one column after the output predicting it
        unpack = lambda x: _unpack(x.reshape(hidden.shape[:2]), mb["unpack_index"] + 1)  # noqa: E731
        router = router._replace(mismatch_bt=unpack(router.mismatch_bt), own_mismatch_bt=unpack(router.own_mismatch_bt))
    return logp, ent, router


def _routing_kwargs(mb: dict, replay: bool, routing: bool) -> dict:
    """The forward's mixture-of-experts keywords for a micro-batch: its recorded routes, whether to replay
    them, whether to return the router statistics (none of them for a plain call)."""
    routes = mb.get("packed_routes", mb.get("routes"))
    if replay and routes is None:
        raise ValueError("routing replay needs the micro-batch's recorded routes (mb['routes'])")
    if routes is None and not routing:
        return {}
    if "packed_routes" in mb:  # [dp, rows, L, layers, k] -> the packed forward's [dp * rows, L, layers, k]
        routes = routes.reshape(-1, *routes.shape[2:])
    return {"routes_btlk": routes, "replay": replay, "return_routing": routing}


def _dropout_kwargs(mb: dict) -> dict:
    """The forward's LoRA-dropout key of a training micro-batch (``dropout_key``, set by
    :func:`make_minibatch_train_step`), or a 1F1B piece's per-row keys (``dropout_rows``, set by
    :func:`pipelined_value_and_grad`); none for scoring's micro-batches, which therefore never drop."""
    if "dropout_rows" in mb:  # [rows, layers, 2], packed: [dp, rows, layers, 2] -> the packed forward's rows
        rows = mb["dropout_rows"]
        return {"dropout_rows": rows.reshape(-1, *rows.shape[-2:])}
    return {"dropout_key": mb["dropout_key"]} if "dropout_key" in mb else {}


def stage_values(params, cfg: ModelConfig, mb: dict, prompt_len: int, forward_fn: ForwardFn = forward) -> jax.Array:
    """:func:`response_values` of a padded or packed micro-batch, [b, R] in the padded layout (a training
    micro-batch's ``dropout_key``: with LoRA dropout)."""
    if "packed_tokens" not in mb:
        return forward_fn(params, cfg, mb["tokens"], None, mb["mask"], **_dropout_kwargs(mb))[:, prompt_len - 1: -1, 0]
    return _unpack(_packed_forward(params, cfg, mb, forward_fn, **_dropout_kwargs(mb))[..., 0], mb["unpack_index"])


def stage_scores(params, cfg: ModelConfig, mb: dict, forward_fn: ForwardFn = forward) -> jax.Array:
    """:func:`sequence_scores` of a padded or packed micro-batch, [b]."""
    if "packed_tokens" not in mb:
        return sequence_scores(params, cfg, mb["tokens"], mb["mask"], forward_fn)
    return _unpack(_packed_forward(params, cfg, mb, forward_fn)[..., 0], mb["unpack_last"])


def split_packed(data: dict, layout, mini: int | None = None) -> dict:
    """``data`` ([rows, ...] host arrays; ``tokens`` / ``mask`` are not needed) packed by ``layout`` (a
    :class:`~nereus_jax.rl.packing.PackedLayout`) as the micro-batches the stages read: the per-sequence fields
    in the layout's order, split like :func:`split_minibatches` (``mini``) or :func:`split_micro` (None), plus the
    packed arrays ``[mini, accum, dp, rows, L]`` (no ``mini`` axis when None) and the gather offsets."""
    fields = {k: np.asarray(v)[layout.order] if np.ndim(v) else v for k, v in data.items()
              if k not in ("tokens", "mask", "routes")}
    fields |= {"unpack_index": layout.index, "unpack_last": layout.last}
    packed = {"packed_tokens": layout.tokens.astype(np.int32), "packed_positions": layout.positions,
              "segment_ids": layout.segments}
    if "routes" in data:  # recorded routes (routing replay), per token like the tokens
        packed["packed_routes"] = packing.pack_tokens(layout, data["routes"], NO_ROUTE)
    if mini is None:
        return split_micro(fields, layout.accum) | {k: v[0] for k, v in packed.items()}
    return split_minibatches(fields, mini, layout.accum) | packed


def _packed_forward(params, cfg: ModelConfig, mb: dict, forward_fn: ForwardFn, *, return_hidden: bool = False,
                    **routing):
    """The forward over a micro-batch's packed rows ``[dp, rows, L]``, as ``[dp, rows * L, ...]`` (with
    ``return_routing`` in ``routing``: and its RouterStats, the mismatch still [dp * rows, L]; ``routing`` may
    also carry the forward's ``dropout_key``)."""
    dp, rows, width = mb["packed_tokens"].shape
    flat = lambda x: x.reshape(dp * rows, width)  # noqa: E731
    out = forward_fn(params, cfg, flat(mb["packed_tokens"]), flat(mb["packed_positions"]), None,
                     return_hidden=return_hidden, segment_ids_bt=flat(mb["segment_ids"]), **routing)
    out, router = out if routing.get("return_routing") else (out, None)
    out = out.reshape(dp, rows * width, *out.shape[2:])
    return (out, router) if routing.get("return_routing") else out


def _unpack(x: jax.Array, index: jax.Array) -> jax.Array:
    """``x`` ``[dp, rows * L]`` at ``index`` ``[b, ...]`` (offsets into the replica's own block; sequences are
    split over dp like the packed rows), so the gather is replica-local: no communication."""
    dp = x.shape[0]
    return jnp.take_along_axis(x, index.reshape(dp, -1), axis=1).reshape(index.shape)


def actor_loss(cfg: ModelConfig, algo: AlgorithmConfig, prompt_len: int, forward_fn: ForwardFn = forward, *,
               vocab_chunk: int = DEFAULT_VOCAB_CHUNK) -> LossFn:
    """The algorithm's clipped policy loss (token or GSPO's sequence ratio, asymmetric clipping, aggregated by
    ``algorithm.loss_agg``), minus the entropy bonus, plus the KL term when it is not in the reward; the
    entropy and KL terms are aggregated like the policy loss; log-probs and entropy over ``vocab_chunk``-wide
    vocabulary chunks (:func:`response_stats`). ``mb["denom"]`` / ``mb["seq_denom"]``: the
    (mini-)batch's tokens / sequences (absent: the micro-batch's own).

    Mixture-of-experts models: ``algorithm.routing_replay`` routes the forward by ``mb["routes"]`` (the
    engine's, recorded at generation), and ``algorithm.router_aux_coef`` adds that times the load-balancing
    loss (:func:`router_aux_loss`)."""
    s = settings(algo, max_response_length=0)  # the loss reads no length-derived setting
    aux = algo.router_aux_coef > 0

    def loss(params, mb):
        logp, entropy, *router = response_stats(params, cfg, mb, prompt_len, forward_fn,
                                                entropy=bool(algo.entropy_coef), vocab_chunk=vocab_chunk,
                                                replay=algo.routing_replay, routing=aux)
        mask, denom, seq_denom = mb["response_mask"], mb.get("denom"), mb.get("seq_denom")
        pl = policy_loss(logp, mb["old_logp"], mb["advantages"], mask, s.clip_low, s.clip_high, agg=s.loss_agg,
                         level=s.ratio_level, denom=denom, seq_denom=seq_denom)
        total, metrics = pl.loss, {"policy_loss": pl.loss, "clip_fraction": pl.clip_fraction,
                                   "approx_kl": pl.approx_kl, "ratio_mean": pl.ratio_mean,
                                   "ratio_max": pl.ratio_max, "ratio_min": pl.ratio_min}
        agg = lambda x: aggregate(x, mask, s.loss_agg, denom, seq_denom)  # noqa: E731
        if algo.entropy_coef:
            entropy = agg(entropy)
            total, metrics["entropy"] = total - algo.entropy_coef * entropy, entropy
        if not algo.kl_in_reward:
            kl = agg(kl_estimate(logp, mb["ref_logp"], algo.kl_estimator))
            total, metrics["kl_loss"] = total + algo.kl_coef * kl, kl
        if aux:
            lb = router_aux_loss(router[0], mask, denom)
            total, metrics["router_aux_loss"] = total + algo.router_aux_coef * lb, lb
        return total, metrics

    return loss


def router_aux_loss(router: RouterStats, response_mask, denom=None) -> jax.Array:
    """A training micro-batch's load-balancing loss (transformers' ``load_balancing_loss_func`` over its
    forward's real tokens, :func:`~nereus_jax.models.routing.load_balancing_loss`) times its share of the
    (mini-)batch's response tokens (``denom``; absent: 1), so the micro-batches' terms sum to their
    token-weighted mean: one micro-batch's is transformers' value exactly. The loss is a product of two
    means, so a different split into micro-batches gives a (slightly) different value."""
    share = 1.0 if denom is None else jnp.sum(response_mask) / denom
    return load_balancing_loss(router) * share


def route_mismatch(router: RouterStats) -> tuple[jax.Array, jax.Array]:
    """[b, R] float32 each: 1 where a response token was routed to other experts than its recorded routes name
    (in some layer), and where the router's own top-k differs from them."""
    return router.mismatch_bt.astype(jnp.float32), router.own_mismatch_bt.astype(jnp.float32)


def critic_loss(cfg: ModelConfig, algo: AlgorithmConfig, prompt_len: int, forward_fn: ForwardFn = forward) -> LossFn:
    """Clipped value loss against the GAE returns."""
    def loss(params, mb):
        values = stage_values(params, cfg, mb, prompt_len, forward_fn)
        vl = value_loss(values, mb["old_values"], mb["returns"], mb["response_mask"], algo.value_clip, mb["denom"])
        return vl, {"value_loss": vl}

    return loss


def sft_loss(cfg: ModelConfig, prompt_len: int, forward_fn: ForwardFn = forward, *,
             vocab_chunk: int = DEFAULT_VOCAB_CHUNK) -> LossFn:
    """Supervised next-token loss on the response (reference answer) tokens only."""
    def loss(params, mb):
        logp, _ = response_stats(params, cfg, mb, prompt_len, forward_fn, vocab_chunk=vocab_chunk)
        nll = -masked_mean(logp, mb["response_mask"], denom=mb["denom"])
        return nll, {"sft_loss": nll}

    return loss


def make_optimizer(lr: float, max_grad_norm: float = 1.0) -> optax.GradientTransformation:
    """AdamW; gradient clipping is done by :func:`make_train_step` on the layout-independent norm."""
    del max_grad_norm
    return optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)


def init_opt_state(optimizer: optax.GradientTransformation, params: dict, cfg: ModelConfig):
    """The optimizer state of ``params``' trainable leaves (all of them, or the adapters and a value head with
    ``cfg.lora_rank``: a frozen base has no optimizer state)."""
    return optimizer.init(split_trainable(params, cfg)[0])


def canonical_global_norm(grads: dict, cfg: ModelConfig) -> jax.Array:
    """Global gradient norm counting each kv head once, whatever copies the layout stores (``grads`` may be
    pruned to the trainable leaves)."""
    rep = stored_kv_repeat(grads, cfg)
    squares = jax.tree.map(lambda g: jnp.sum(jnp.square(g.astype(jnp.float32))), grads)
    total = sum(jax.tree.leaves(squares))
    if rep > 1:
        dup = sum(v for k, v in squares["layers"]["attn"].items()
                  if k in ("wk", "wv", "bk", "bv", "wk_lora_b", "wv_lora_b"))
        total = total - dup * (1.0 - 1.0 / rep)
    return jnp.sqrt(total)


def make_train_step(loss_fn: LossFn | None, optimizer: optax.GradientTransformation, cfg: ModelConfig,
                    max_grad_norm: float = 1.0, *, value_and_grad: GradFn | None = None, param_shardings=None):
    """(params, opt_state, micro_batches [accum, rows, ...]) -> (params, opt_state, metrics). ``value_and_grad``
    (default ``jax.value_and_grad(loss_fn, has_aux=True)``) gives each micro-batch's loss, metrics and gradients:
    :func:`pipelined_value_and_grad` for the 1F1B pipeline. ``param_shardings`` (a tree like ``params``): where
    the parameters the forward reads and the gradients are pinned. With an optimizer state split over dp, the
    partitioner would otherwise carry that split back from the update into the forward and backward (gathering
    activations over dp) and sum in another order than replicas with whole copies do: the same update, but not
    bit for bit."""
    grad_fn = value_and_grad or jax.value_and_grad(loss_fn, has_aux=True)
    grad_shardings = None if param_shardings is None else split_trainable(param_shardings, cfg)[0]
    pin = (lambda g: g) if grad_shardings is None else (
        lambda g: jax.lax.with_sharding_constraint(g, grad_shardings))

    def step(params, opt_state, batches):
        # With LoRA only the adapters (and a value head) train: the frozen base's gradients are never
        # accumulated (XLA drops their computation), it has no optimizer state, and it leaves the step as
        # the same buffers, bit for bit. Without LoRA ``trainable`` is the whole tree.
        if param_shardings is not None:
            params = jax.lax.with_sharding_constraint(params, param_shardings)
        trainable, frozen = split_trainable(params, cfg)

        def micro(acc, mb):
            (loss, metrics), grads = grad_fn(params, mb)
            return jax.tree.map(jnp.add, acc, pin(split_trainable(grads, cfg)[0])), (loss, metrics)

        zeros = pin(jax.tree.map(jnp.zeros_like, trainable))
        grads, (losses, metrics) = jax.lax.scan(micro, zeros, batches)
        grads = pin(sync_kv_grads(grads, cfg))
        norm = canonical_global_norm(grads, cfg)
        scale = jnp.minimum(1.0, max_grad_norm / jnp.maximum(norm, 1e-12))
        grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
        updates, new_opt = optimizer.update(grads, opt_state, trainable)
        new_params = optax.apply_updates(trainable, updates)
        loss = jnp.sum(losses)
        # A non-finite loss, gradient norm or updated parameter skips the update: the state stays as it was
        # (a select, not arithmetic, so it is the same bits), and "nonfinite" says the step was skipped.
        finite = [jnp.isfinite(loss), jnp.isfinite(norm)] + [jnp.all(jnp.isfinite(x)) for x in
                                                            jax.tree.leaves(new_params)]
        ok = jnp.all(jnp.stack(finite))
        keep = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
        trainable, opt_state = jax.tree.map(keep, new_params, trainable), jax.tree.map(keep, new_opt, opt_state)
        params = join(trainable, frozen)
        if param_shardings is not None:  # whole on the way out too: a loop over updates carries whole parameters
            params = jax.lax.with_sharding_constraint(params, param_shardings)
        out = {"loss": loss, "grad_norm": norm, "nonfinite": (~ok).astype(jnp.float32),
               **{k: _REDUCE.get(k.rsplit("_", 1)[-1], jnp.sum)(v) for k, v in metrics.items()}}
        return params, opt_state, out

    return step


_REDUCE = {"max": jnp.max, "min": jnp.min}  # a micro-batch metric named *_max / *_min; the rest are sums


def pipelined_value_and_grad(make_loss: MakeLoss, mesh, microbatches, kind: str = "train") -> GradFn:
    """A drop-in for ``jax.value_and_grad(make_loss(forward_fn), has_aux=True)`` on a mesh that pipelines: the
    1F1B schedule (:func:`~nereus_jax.sharding.pipeline.pipeline_value_and_grad`) over the call's micro-batch split
    into pipeline micro-batches (:func:`pipeline_split`; ``microbatches``: a count, or a function of (rows per
    replica, pp) as :func:`~nereus_jax.sharding.pipeline.pipeline_forward_fn` takes). The pieces' losses sum and
    their metrics combine as :func:`make_train_step` combines micro-batches' (sums; ``*_max`` / ``*_min``: the
    extreme), so, like gradient accumulation, the loss must normalise by the whole batch's counts (``denom``,
    ``seq_denom``) for the result to equal the unsplit loss."""
    def fn(params, mb):
        if "dropout_key" in mb:  # LoRA dropout: the call's per-row keys, split with its rows (as pp = 1 draws them)
            mb = _dropout_rows(mb, jax.tree.leaves(params["layers"])[0].shape[0])
        m = pipe.call_microbatches(make_loss, params, mb, mesh=mesh, microbatches=microbatches, kind=kind)
        (losses, metrics), grads = pipe.pipeline_value_and_grad(make_loss, params, pipeline_split(mb, m), mesh=mesh,
                                                                kind=kind)
        return (jnp.sum(losses), {k: _REDUCE.get(k.rsplit("_", 1)[-1], jnp.sum)(v) for k, v in metrics.items()}), grads

    return fn


_PACKED_ROWS = ("packed_tokens", "packed_positions", "segment_ids", "packed_routes", "dropout_rows")


def _dropout_rows(mb: dict, num_layers: int) -> dict:
    """``mb`` with its ``dropout_key`` replaced by the keys the unpipelined forward draws from it, one per layer and
    row of the model call (``lora.row_keys``), row-major: [rows, layers, 2] (packed: [dp, rows, layers, 2], the
    packed rows' shape), so :func:`pipeline_split` hands each piece its rows' keys."""
    shape = mb["packed_tokens"].shape[:2] if "packed_tokens" in mb else mb["tokens"].shape[:1]
    keys = jnp.moveaxis(row_keys(mb["dropout_key"], num_layers, math.prod(shape)), 0, 1)
    keys = keys.reshape(*shape, *keys.shape[1:])
    return {k: v for k, v in mb.items() if k != "dropout_key"} | {"dropout_rows": keys}


def pipeline_split(mb: dict, m: int) -> dict:
    """A loss's micro-batch (padded or packed) as ``m`` pipeline micro-batches, every leaf ``[m, ...]``, whose
    losses sum to its loss when it carries the whole batch's normalisers. Padded: piece i holds rows i, i + m,
    ... (the pipeline's own split, so a dp split of the rows stays one). Packed: piece i holds each replica's
    packed rows i, i + m, ... and every sequence's fields, those of sequences in other pieces' rows masked out
    (``response_mask`` 0; their gather offsets point into piece i's rows, as a padding token's do), since the
    sequences per packed row vary with the data. Scalars are repeated."""
    if "packed_tokens" not in mb:
        return {k: _pieces(v, m) for k, v in mb.items()}
    width = mb["packed_tokens"].shape[-1]
    member = (mb["unpack_last"] // width) % m == jnp.arange(m)[:, None]  # [m, b]: the piece holding each sequence

    def offsets(index):  # row * L + column in the replica's rows -> (row // m) * L + column in the piece's
        return jnp.broadcast_to((index // width // m) * width + index % width, (m, *index.shape))

    out = {}
    for k, v in mb.items():
        if k in _PACKED_ROWS:  # [dp, rows, L, ...] -> [m, dp, rows / m, L, ...]
            out[k] = jnp.moveaxis(v.reshape(v.shape[0], -1, m, *v.shape[2:]), 2, 0)
        elif k in ("unpack_index", "unpack_last"):
            out[k] = offsets(v)
        elif k == "response_mask":
            out[k] = v * member[:, :, None].astype(v.dtype)
        else:
            out[k] = _pieces(v, m, split=False)
    return out


def _pieces(x, m: int, split: bool = True) -> jax.Array:
    """[rows, ...] -> [m, rows / m, ...] (piece i: rows i, i + m, ...), or ``x`` repeated ``m`` times (scalars,
    or ``split`` False)."""
    x = jnp.asarray(x)
    if x.ndim == 0 or not split:
        return jnp.broadcast_to(x, (m, *x.shape))
    return jnp.moveaxis(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 1, 0)


def make_minibatch_train_step(loss_fn: LossFn | None, optimizer: optax.GradientTransformation, cfg: ModelConfig,
                              epochs: int = 1, max_grad_norm: float = 1.0, *, value_and_grad: GradFn | None = None,
                              param_shardings=None):
    """(params, opt_state, batches [mini, accum, rows, ...]) -> (params, opt_state, metrics [epochs * mini]):
    ``epochs`` passes over the mini-batches in order, one :func:`make_train_step` update each (a non-finite
    one is skipped, the next starts from the kept state). The caller's ``old_logp`` are the generating
    step's, so the first update's ratio is 1 and the later ones' move away from it.

    LoRA dropout: ``batches["dropout_seed"]`` ([mini, accum] uint32, the step's seed repeated; the learner adds it
    when ``model.lora_dropout`` > 0) becomes each micro-batch's ``dropout_key`` (:func:`~nereus_jax.models.lora.
    dropout_keys`: a new key per epoch and micro-batch). Without it the program is the one without dropout."""
    update = make_train_step(loss_fn, optimizer, cfg, max_grad_norm, value_and_grad=value_and_grad,
                             param_shardings=param_shardings)

    def step(params, opt_state, batches):
        batches = dict(batches)
        seed = batches.pop("dropout_seed", None)

        def one(carry, mb):
            params, opt_state, metrics = update(*carry, mb)
            return (params, opt_state), metrics

        def epoch(carry, e):
            if seed is None:
                return jax.lax.scan(one, carry, batches)
            keys = dropout_keys(seed[0, 0], e, *seed.shape)
            return jax.lax.scan(one, carry, batches | {"dropout_key": keys})

        xs = None if seed is None else jnp.arange(epochs)
        (params, opt_state), metrics = jax.lax.scan(epoch, (params, opt_state), xs, length=epochs)
        return params, opt_state, jax.tree.map(lambda x: x.reshape(-1), metrics)

    return step


def split_minibatches(batch: dict, mini: int, accum: int) -> dict:
    """[rows, ...] host arrays -> [mini, accum, rows / (mini * accum), ...]: mini-batch m holds rows
    m*rows/mini .. (m+1)*rows/mini - 1 (a prompt's samples stay together when rows/mini is a multiple of
    them), split into ``accum`` micro-batches. Adds each mini-batch's normalisers, repeated per micro-batch
    ([mini, accum]): ``denom`` its response tokens and ``seq_denom`` its sequences with a token (both >= 1).
    A scalar (``dropout_seed``) is repeated per micro-batch too."""
    out = {k: np.full((mini, accum), v, np.asarray(v).dtype) if np.ndim(v) == 0 else
           np.asarray(v).reshape(mini, accum, -1, *np.shape(v)[1:]) for k, v in batch.items()}
    lengths = out["response_mask"].reshape(mini, -1, np.shape(batch["response_mask"])[-1]).sum(-1)
    for key, value in (("denom", lengths.sum(-1)), ("seq_denom", (lengths > 0).sum(-1))):
        out[key] = np.repeat(np.maximum(value, 1).astype(np.float32)[:, None], accum, axis=1)
    return out


def put_minibatches(data: dict, mesh) -> dict:
    """Places ``split_minibatches`` output on ``mesh``: rows split over ``dp``, normalisers replicated."""
    rows = NamedSharding(mesh, PartitionSpec(None, None, "dp"))
    whole = NamedSharding(mesh, PartitionSpec())
    return {k: jax.device_put(v, rows if np.ndim(v) > 2 else whole) for k, v in data.items()}


def put_micro(micro: dict, mesh) -> dict:
    """Places ``split_micro`` output on ``mesh``: rows split over ``dp``, scalars replicated."""
    rows = NamedSharding(mesh, PartitionSpec(None, "dp"))
    whole = NamedSharding(mesh, PartitionSpec())
    return {k: jax.device_put(v, rows if np.ndim(v) > 1 else whole) for k, v in micro.items()}


def split_micro(batch: dict, accum: int) -> dict:
    """[rows, ...] host arrays -> [accum, rows / accum, ...]; the scalar ``denom`` is repeated."""
    out = {}
    for k, v in batch.items():
        v = np.asarray(v)
        out[k] = np.full((accum,), v, v.dtype) if v.ndim == 0 else v.reshape(accum, -1, *v.shape[1:])
    return out
