"""``materialize.tags``: tags numbered per (src, dst) channel, the same in every data-parallel replica."""

from __future__ import annotations

import pytest
import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.materialize.program import Recv, Send
from lightning_nnscaler.materialize.tags import TAG_LIMIT, ChannelTags, TagLimitError
from lightning_nnscaler.models.gpt import GPT, GPTConfig


def test_each_channel_numbers_its_own_messages_and_a_rank_tells_its_peers_apart() -> None:
    tags = ChannelTags(4)
    assert [tags.next(0, 1), tags.next(0, 1), tags.next(0, 2), tags.next(1, 0), tags.next(2, 3)] == [5, 9, 6, 7, 5]


def test_a_channel_with_more_messages_than_tags_is_refused() -> None:
    tags = ChannelTags(TAG_LIMIT // 2)
    tags.next(0, 1)
    with pytest.raises(TagLimitError, match="rank 0 sends rank 1 2 messages"):
        tags.next(0, 1)


def test_data_parallel_replicas_send_the_same_tags_between_the_same_stages() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=8, hidden=16, layers=2, heads=2))
    model.log = lambda *args, **kwargs: None
    batch = model.example_batch(8, torch.Generator().manual_seed(0))
    plan = lnn.parallelize(model, batch, "1f1b", 4, step="training_step", stages=2, microbatches=2)
    layout = plan.data_layout

    def messages(rank: int) -> list[tuple[str, int, int]]:
        """Rank ``rank``'s messages inside its replica: kind, peer's offset from the rank, tag."""
        found = []
        for action in plan.materialized.ranks[rank].actions:
            peer = action.dst if isinstance(action, Send) else action.src if isinstance(action, Recv) else None
            if peer is not None and layout.replica(peer) == layout.replica(rank):
                found.append((type(action).__name__, peer - rank, action.tag))
        return found

    assert messages(0) and messages(0) == messages(2)
    assert messages(1) == messages(3)
