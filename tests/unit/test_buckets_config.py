"""Settings of the weight sync: bad values are refused naming the field and the fix."""

import pytest
import torch

from asyncrl.sync import BroadcastSender as WeightSender
from asyncrl.sync import GroupInit, WeightSyncConfig, WeightSyncCoordinator, WeightSyncer


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bucket_mb": 0}, "WeightSyncConfig.bucket_mb must be > 0"),
        ({"backend": "mpi"}, "WeightSyncConfig.backend must be 'auto', 'gloo' or 'nccl'"),
        ({"workers_per_engine": 0}, "WeightSyncConfig.workers_per_engine must be >= 1"),
        ({"pause_timeout_s": 0}, "WeightSyncConfig.pause_timeout_s must be > 0"),
        ({"transfer_timeout_s": -1}, "WeightSyncConfig.transfer_timeout_s must be > 0"),
        ({"retries": -1}, "WeightSyncConfig.retries must be >= 0"),
    ],
)
def test_sync_config_names_the_bad_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WeightSyncConfig(**kwargs)


def test_group_config_and_sender_refuse_bad_values():
    with pytest.raises(ValueError, match="world_size must be >= 2"):
        GroupInit(world_size=1)
    with pytest.raises(ValueError, match="master_port must be in"):
        GroupInit(master_port=70000)
    with pytest.raises(ValueError, match="bucket_mb must be > 0"):
        WeightSender(torch.nn.Linear(2, 2), rank=0, bucket_mb=0, world_size=2)


def test_coordinator_needs_members_and_is_a_weight_syncer():
    with pytest.raises(ValueError, match="trainer_workers is empty"):
        WeightSyncCoordinator([], [object()])
    with pytest.raises(ValueError, match="engine_actors is empty"):
        WeightSyncCoordinator([object()], [])
    coord = WeightSyncCoordinator([object()], {"a": object()}, version=4)
    assert isinstance(coord, WeightSyncer) and coord.version == 4 and list(coord.engines) == ["a"]


def test_sender_on_a_non_zero_rank_does_not_join():
    sender = WeightSender(torch.nn.Linear(2, 2), rank=1, world_size=3)
    assert sender.connect() is None
    stats = sender.send(version=1)  # only gathers (nothing to gather on an unsharded model)
    assert stats["bytes_sent"] == 0 and stats["meta_sends"] == 0
