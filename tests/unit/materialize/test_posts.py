"""``materialize.posts``: a receive is posted where its message is sent (inline messages, same segment)."""

from __future__ import annotations

import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.materialize.posts import receive_posts
from lightning_nnscaler.materialize.program import Recv
from lightning_nnscaler.models.gpt import GPT, GPTConfig


def gpt_and_batch() -> tuple[GPT, object]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=8, hidden=16, layers=2, heads=2))
    model.log = lambda *args, **kwargs: None
    return model, model.example_batch(4, torch.Generator().manual_seed(0))


def test_data_parallel_ranks_post_the_loss_count_where_the_peer_sends_it_and_receive_it_at_the_end_of_the_forward() -> None:
    model, batch = gpt_and_batch()
    plan = lnn.parallelize(model, batch, "dp", 2, step="training_step")
    posts = receive_posts(plan.materialized)
    receives = {(action.src, program.rank, action.tag): action for program in plan.materialized.ranks for action in program.actions
                if isinstance(action, Recv)}
    assert set(posts) == set(receives)  # the count, each way
    assert all(posts[key] < receives[key].position for key in posts)
    lines = plan.sources[0].splitlines()
    post = next(index for index, line in enumerate(lines) if "communicator.post_recv(" in line)
    receive = next(index for index, line in enumerate(lines) if "comm.recv(token" in line)
    first_linear = next(index for index, line in enumerate(lines) if "aten.linear" in line or "aten.addmm" in line)
    assert post < first_linear < receive
    assert lines[post].strip() == "communicator.post_recv((), torch.int64, 1, 3)  # where rank 1 sends it"  # tag 3: first message on the channel, 2 ranks (materialize.tags)


def test_pipeline_boundary_messages_are_not_posted_ahead() -> None:
    model, batch = gpt_and_batch()
    plan = lnn.parallelize(model, batch, "1f1b", 2, step="training_step", microbatches=2)
    boundary = {(action.src, program.rank, action.tag) for program in plan.materialized.ranks for action in program.actions
                if isinstance(action, Recv) and action.boundary}
    assert boundary and not boundary & set(receive_posts(plan.materialized))
