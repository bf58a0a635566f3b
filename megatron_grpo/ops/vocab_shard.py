"""`VocabShard`: where this tensor-parallel rank's slice of the vocabulary sits. The one description of the shard,
carried unchanged from the public APIs (the ops, `ClippedPGLoss`, the Megatron step) down to the kernels.

Megatron pads the vocab to a multiple of `tp * make_vocab_size_divisible_by` and gives rank `r` the columns
`[r * V_local, (r + 1) * V_local)` of the padded vocab. Ids at or beyond the true vocab size are padding: they
never enter a softmax and are never targets. `megatron_grpo.megatron.vocab_shard_of(model, true_vocab_size)`
builds one from a GPTModel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group


@dataclass(frozen=True)
class VocabShard:
    """This rank's vocab shard: the global id of its first column, the true (unpadded) vocab size, and the TP
    group the vocab is split over.

    `start_index=None` means `rank(group) * V_local` and `true_vocab_size=None` means no padding; `resolve`
    fills both in from the local width. The default, `VocabShard()`, is an unsharded vocab.
    """

    start_index: int | None = None
    true_vocab_size: int | None = None
    group: dist.ProcessGroup | None = None

    def resolve(self, local_vocab: int) -> "VocabShard":
        """The same shard with `start_index` and `true_vocab_size` made explicit for `local_vocab` columns."""
        rank, world = (0, 1) if self.group is None else (dist.get_rank(self.group), dist.get_world_size(self.group))
        start = rank * local_vocab if self.start_index is None else int(self.start_index)
        if start < 0:
            raise ValueError(f"vocab shard start_index must be >= 0, got {start}")
        padded_vocab = world * local_vocab
        true_vocab = max(padded_vocab, start + local_vocab) if self.true_vocab_size is None \
            else int(self.true_vocab_size)
        if true_vocab <= 0:
            raise ValueError(f"vocab shard true_vocab_size must be > 0, got {true_vocab}")
        # Without a group and with an explicit start, the shard is emulated (one rank's view): nothing to compare.
        sharded = self.start_index is None or self.group is not None
        if sharded and start != rank * local_vocab:
            raise ValueError(
                f"vocab shard start_index={start} disagrees with the local vocab of {local_vocab} rows/columns on TP "
                f"rank {rank}: Megatron's rank {rank} holds ids from {rank * local_vocab}"
            )
        if sharded and true_vocab > padded_vocab:
            raise ValueError(
                f"vocab shard true_vocab_size={true_vocab} exceeds the sharded vocab of {world} rank(s) x "
                f"{local_vocab} columns = {padded_vocab}: some token ids would belong to no rank"
            )
        return VocabShard(start_index=start, true_vocab_size=true_vocab, group=self.group)

    def valid_cols(self, local_vocab: int) -> int:
        """How many of this (resolved) shard's `local_vocab` columns are real vocab, not padding."""
        if self.start_index is None or self.true_vocab_size is None:
            raise ValueError("VocabShard.valid_cols needs a resolved shard (call resolve first)")
        return min(max(self.true_vocab_size - self.start_index, 0), local_vocab)

    @property
    def tp_size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    @property
    def group_name(self) -> str:
        """The TP group's name, "" without a group. A process group cannot be an argument of a `torch.library`
        op: the traceable ops take its name and find the group again (`with_group_name`), as torch's functional
        collectives do."""
        return "" if self.group is None else self.group.group_name

    @classmethod
    def with_group_name(cls, start_index: int | None, true_vocab_size: int | None, group_name: str) -> "VocabShard":
        """The shard whose group is the process group named `group_name` ("" = none)."""
        group = _resolve_process_group(group_name) if group_name else None
        return cls(start_index=start_index, true_vocab_size=true_vocab_size, group=group)
