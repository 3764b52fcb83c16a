"""The MemoryTier contract, for every memory tier."""

import pytest
import torch

from kvtier.tiers.gpu import DevicePool
from kvtier.tiers.host import HostTier

SLOT = 8192


@pytest.fixture(params=["host", "device"])
def tier(request):
    made = HostTier(4, SLOT) if request.param == "host" else DevicePool(4, SLOT)
    yield made
    made.close()


def test_slots_have_the_promised_size_and_type(tier):
    for i in range(tier.num_slots):
        view = tier.slot(i)
        assert view.dtype == torch.uint8 and view.numel() == SLOT and view.is_contiguous()
        assert view.device.type == tier.device.type
    assert tier.capacity_bytes == 4 * SLOT


def test_slots_are_views_that_do_not_overlap(tier):
    for i in range(tier.num_slots):
        tier.slot(i).fill_(i + 1)
    for i in range(tier.num_slots):
        assert torch.all(tier.slot(i) == i + 1)


def test_slots_are_page_aligned(tier):
    if tier.device.type != "cpu":
        pytest.skip("device slots follow the device allocator's alignment")
    for i in range(tier.num_slots):
        assert tier.slot(i).data_ptr() % 4096 == 0


def test_out_of_range_slot_is_an_index_error(tier):
    with pytest.raises(IndexError):
        tier.slot(tier.num_slots)
    with pytest.raises(IndexError):
        tier.slot(-1)


def test_a_run_of_slots_is_one_view_of_those_slots_in_order(tier):
    run = tier.slots(1, 3)
    assert run.shape == (3, SLOT) and run.dtype == torch.uint8
    for j in range(3):
        run[j].fill_(10 + j)
    assert [int(tier.slot(i)[0]) for i in range(1, 4)] == [10, 11, 12]
    assert torch.equal(tier.slots(2, 1)[0], tier.slot(2))


@pytest.mark.parametrize("first, count", [(3, 2), (-1, 1), (0, 0), (0, 5)])
def test_a_run_past_the_tier_or_empty_is_refused(tier, first, count):
    with pytest.raises((IndexError, ValueError)):
        tier.slots(first, count)


def test_close_twice_is_fine(tier):
    tier.close()
    tier.close()


@pytest.mark.parametrize("cls", [HostTier, DevicePool])
def test_unaligned_slot_size_is_refused(cls):
    with pytest.raises(ValueError, match="multiple of 4096"):
        cls(2, 1000)


def test_host_tier_is_one_allocation():
    tier = HostTier(3, SLOT)
    base = tier.slot(0).data_ptr()
    assert [tier.slot(i).data_ptr() - base for i in range(3)] == [0, SLOT, 2 * SLOT]
    assert tier.slot_array(1).ctypes.data == base + SLOT
    assert tier.pinned is torch.cuda.is_available()
    tier.close()
