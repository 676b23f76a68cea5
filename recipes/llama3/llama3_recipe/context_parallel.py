"""Context parallelism (CP) for the Llama 3 recipe (train_fsdp2_cp.py): the
Llama spec of recipe_common's loop (llama3_recipe.trainer) with what CP
changes, everything else read from it.

The layout: ``world = dp x cp`` ranks in a 2-D torch DeviceMesh with
dimensions ("dp", "cp"), cp innermost (rank = dp_rank * cp + cp_rank, so a
CP group's ranks are neighbours: on one node they share NVLink).
  * CP: the model's layers run attention under CP over the mesh's "cp"
    group (SeqfuseLlamaForCausalLM.set_context_parallel_group with
    ``cp_comm_type``), each CP rank holding 1/cp of every sequence.
  * Data: the loader is the Llama recipe's, built for the dp rank of dp
    ranks, so the cp ranks of one dp rank read the same batches (the crops
    and the order are functions of seed, epoch and index).  Before the
    model, each batch is cut for this rank (``CPBatches``, as BioNeMo's
    recipe does): the next-token targets shifted over the full sequences,
    every packed sequence padded at its end to a multiple of 2*cp (padded
    rows: the row length), and the load-balanced split
    (seqfuse.distributed.split_batch_for_cp_rank's rule: chunks r and 2cp-1-r).
    Under FP8 / FP4 the rank's token count is kept a multiple of
    data.pad_to_multiple_of (one dummy packed segment, or longer rows).
  * FSDP2: fully_shard over all dp x cp ranks (the mesh flattened, which is
    the world in rank order), as TorchTitan and BioNeMo's CP recipe do: the
    parameters are the same on every CP rank, so sharding them over the cp
    ranks too saves their memory, and the gradient reduction FSDP2 does
    (the mean over all ranks) is the right one: every CP rank returns the
    whole sequences' loss, and the mean of the CP ranks' gradients is the
    CP=1 gradient (seqfuse.hf.context_parallel).  So a dp x cp run's update
    is a dp-rank run's update on the same batches.
  * Logging counts every token once: a rank's tokens/s and real tokens are
    its share; FLOPs per rank are the full sequences' over cp.
  * Checkpoints are the loop's (DCP shards of the dp x cp FSDP2 layout, RNG
    per rank, the data position), so resume needs the same world size and
    cp_size; the Hugging Face export gathers the full model (FSDP2's full
    state dict) and writes it on rank 0 as train_fsdp2.py does.

What CP does not do here: padded (bshd) rows take no attention mask under
CP (right padding is exact for the real tokens under the causal mask; the
labels are -100 there), and attention dropout is refused by the CP
attention (Llama has none).
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from seqfuse.hf.lm_layout import IGNORE_INDEX

from . import trainer as _llama

log = logging.getLogger("llama3")


class CPBatches:
    """A loader of full batches, seen as this CP rank's share of each
    (see the module note); ``state_dict`` / ``load_state_dict`` / ``len``
    are the wrapped loader's.  Keys of a share: input_ids (the rank's
    tokens), labels (their next-token targets, already shifted: the model's
    ``shift_labels``), cu_seqlens / max_seqlen (packed: the full padded
    batch's), num_tokens (the rank's real tokens), seq_lengths (the full
    batch's real sequence lengths, for FLOPs), num_sequences."""

    def __init__(self, loader, cp_size, cp_rank, pad_token_id, pad_to_multiple_of=None):
        if not isinstance(cp_size, int) or cp_size < 1 or not isinstance(cp_rank, int) \
                or not 0 <= cp_rank < cp_size:
            raise ValueError(f"CPBatches: cp_rank must be in [0, cp_size), got cp_rank={cp_rank!r}, "
                             f"cp_size={cp_size!r}")
        self.loader, self.cp, self.rank = loader, cp_size, cp_rank
        self.pad_token_id, self.multiple = pad_token_id, pad_to_multiple_of

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            yield self.share(batch)

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, state):
        self.loader.load_state_dict(state)

    def share(self, batch):
        """This rank's share of one full collated batch (packed or padded)."""
        from seqfuse.hf.llama import shift_labels

        if "cu_seqlens" in batch:
            return self._packed(batch, shift_labels(batch["labels"], batch["cu_seqlens"]))
        return self._padded(batch, shift_labels(batch["labels"]))

    def _take(self, index, dim, *tensors):
        return [t.index_select(dim, index) for t in tensors]

    def _packed(self, batch, targets):
        from seqfuse.distributed import local_token_index, pad_thd_sequences_for_cp

        cu, n_real = batch["cu_seqlens"], int(batch["num_sequences"])
        lengths = (cu[1:] - cu[:-1]).long()
        real_lengths = lengths[:n_real].tolist()  # (a collator's padding segment comes last)
        real = torch.zeros_like(batch["input_ids"])
        real[: int(cu[n_real])] = 1
        ids, targets, cu_p = pad_thd_sequences_for_cp(batch["input_ids"], targets, cu, self.cp,
                                                      padding_token_id=self.pad_token_id)
        real, _, _ = pad_thd_sequences_for_cp(real, None, cu, self.cp, padding_token_id=0)
        total, m = ids.numel(), self.multiple
        if m:  # the rank's token count a multiple of m: a dummy segment (a multiple of 2*cp long)
            extra = -total % (m * self.cp)
            if extra:
                ids = torch.cat([ids, ids.new_full((extra,), self.pad_token_id)])
                targets = torch.cat([targets, targets.new_full((extra,), IGNORE_INDEX)])
                real = torch.cat([real, real.new_zeros(extra)])
                cu_p = torch.cat([cu_p, cu_p.new_tensor([total + extra])])
        padded_lengths = (cu_p[1:] - cu_p[:-1]).long()
        index = local_token_index(padded_lengths, self.cp, self.rank)
        ids, targets, real = self._take(index, 0, ids, targets, real)
        return {"input_ids": ids, "labels": targets, "cu_seqlens": cu_p, "max_seqlen": int(padded_lengths.max()),
                "num_tokens": int(real.sum()), "num_sequences": n_real, "seq_lengths": real_lengths}

    def _padded(self, batch, targets):
        from seqfuse.distributed import local_token_index

        ids, mask = batch["input_ids"], batch["attention_mask"]
        s = ids.shape[1]
        step = 2 * self.cp * (self.multiple or 1)
        extra = -s % step
        if extra:  # longer rows: padding on the right, no target there
            ids = torch.nn.functional.pad(ids, (0, extra), value=self.pad_token_id)
            targets = torch.nn.functional.pad(targets, (0, extra), value=IGNORE_INDEX)
            mask = torch.nn.functional.pad(mask, (0, extra), value=0)
        index = local_token_index(torch.tensor([s + extra]), self.cp, self.rank)
        ids, targets, mask = self._take(index, 1, ids, targets, mask)
        return {"input_ids": ids, "labels": targets, "num_tokens": int(mask.sum()),
                "num_sequences": int(batch["attention_mask"].shape[0]),
                "seq_lengths": batch["attention_mask"].sum(-1).tolist()}


class ContextParallelSpec:
    """recipe_common.trainer's ``spec`` for a CP run: llama3_recipe.trainer
    with the CP changes of the module note.  Attributes it does not define
    are the Llama spec's."""

    def __init__(self):
        self.mesh = None

    def __getattr__(self, name):
        return getattr(_llama, name)

    # ------------------------------------------------------------ checks and layout
    def check_run(self, cfg, device):
        _llama.check_run(cfg, device, context_parallel=True)

    def _layout(self, cfg):
        """(dp size, dp rank, cp size, cp rank) of this process."""
        cp = int(cfg.cp_size)
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if world % cp:
            raise ValueError(f"cp_size={cp}: the number of processes ({world}) must be a multiple of cp_size "
                             f"(dp x cp ranks)")
        return world // cp, rank // cp, cp, rank % cp

    def build_model(self, cfg, device, dtype):
        """The Llama recipe's model, with the ("dp", "cp") DeviceMesh made
        and the model's layers put under CP over its "cp" group."""
        model, mcfg = _llama.build_model(cfg, device, dtype)
        dp, _, cp, _ = self._layout(cfg)
        if dist.is_initialized():
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
            if cp > 1:
                group = self.mesh.get_group("cp")
                model.set_context_parallel_group(group, dist.get_process_group_ranks(group), None,
                                                 str(cfg.cp_comm_type))
            if dist.get_rank() == 0:
                log.info("context parallelism: %d dp x %d cp ranks (mesh %s), cp_comm_type %s; FSDP2 over all %d",
                         dp, cp, self.mesh.mesh.tolist(), cfg.cp_comm_type, dp * cp)
        return model, mcfg

    # ------------------------------------------------------------ data
    def build_loaders(self, cfg, rank, world, recipe, pin_memory=False):
        """The Llama recipe's loaders for the dp rank of dp ranks, each batch
        then cut for this CP rank (CPBatches).  The collator's own padding is
        off: CPBatches pads for CP and, under FP8 / FP4, to the multiple."""
        dp, dp_rank, cp, cp_rank = self._layout(cfg)
        quantized = recipe is not None or bool(cfg.precision.fp4)
        multiple = cfg.data.pad_to_multiple_of
        if multiple == "auto":
            multiple = 16 if quantized else None
        plain = type(cfg).wrap(cfg.to_dict())
        plain.data.pad_to_multiple_of = None
        train, val, n_train, n_val = _llama.build_loaders(plain, dp_rank, dp, recipe, pin_memory)
        pad = _llama.tokenizer().pad_token_id
        return (CPBatches(train, cp, cp_rank, pad, multiple), CPBatches(val, cp, cp_rank, pad, multiple),
                n_train, n_val)

    def forward_loss(self, model, batch):
        """The whole sequences' loss, the same on every CP rank (the model
        reduces it over the CP group)."""
        kw = dict(cu_seqlens=batch["cu_seqlens"], max_seqlen=int(batch["max_seqlen"])) if "cu_seqlens" in batch \
            else {}
        return model(input_ids=batch["input_ids"], shift_labels=batch["labels"], **kw).loss

    def step_flops(self, host_batch, mcfg):
        """This rank's share of the step's FLOPs (the full sequences' / cp)."""
        cp = int(self.mesh.size(1)) if self.mesh is not None else 1
        return _llama.train_flops(host_batch["seq_lengths"], mcfg) / cp


def train(cfg, strategy: str = "fsdp2") -> dict:
    """One CP training run (recipe_common.trainer.train with
    ContextParallelSpec); returns its history."""
    from recipe_common import trainer as loop

    if strategy != "fsdp2":
        raise ValueError(f"context parallelism runs under FSDP2 (strategy 'fsdp2'), got {strategy!r}")
    return loop.train(cfg, strategy, ContextParallelSpec())


__all__ = ["CPBatches", "ContextParallelSpec", "train"]
