"""The patches of torch internals (fsdp_compile/compile/torch_patches.py): each one's version gate
matches the installed torch, and a feature whose patch does not apply is refused with a sentence."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import fsdp_compile  # noqa: F401  installs the patches
from fsdp_compile.compile import torch_patches


@pytest.mark.parametrize("patch", torch_patches.TORCH_PATCHES, ids=lambda patch: patch.name)
def test_each_patch_gate_admits_the_installed_torch_exactly_where_its_target_is_there(patch):
    assert patch.gate_admits() == patch.target_present(), (patch.name, torch.__version__)


@pytest.mark.parametrize("patch", torch_patches.TORCH_PATCHES, ids=lambda patch: patch.name)
def test_each_patch_gate_refuses_torch_releases_outside_its_range(patch):
    major, minor = patch.first
    assert not patch.gate_admits(f"{major}.{minor - 1}.0" if minor else f"{major - 1}.99.0")
    assert not patch.gate_admits(f"{patch.last[0]}.{patch.last[1] + 1}.0+cpu")
    assert patch.gate_admits(f"{major}.{minor}.0+cu126")


def test_the_patches_applied_at_import_are_applied():
    applied = {patch.name for patch in torch_patches.TORCH_PATCHES if patch.at_import and patch.applies()}
    assert applied <= torch_patches._applied, sorted(applied - torch_patches._applied)


def test_a_feature_whose_patch_does_not_apply_is_refused_naming_the_patch_and_the_way_out(monkeypatch):
    patch = torch_patches._BY_NAME["recompile limit per block structure"]
    outside = dataclasses.replace(patch, first=(1, 0), last=(1, 1))
    monkeypatch.setitem(torch_patches._BY_NAME, patch.name, outside)
    monkeypatch.setattr(torch_patches, "_applied", set())
    with pytest.raises(NotImplementedError, match="recompile limit per block structure.*block_compile = \"regions\""):
        torch_patches.require(patch.name)
