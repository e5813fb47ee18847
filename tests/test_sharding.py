"""Models larger than one device: the training step on meshes of (data, fsdp, tensor) takes the single-device
step (tests/helpers/mesh_paths.py in a child process with 8 simulated CPU devices), each device holds its share of
the state, the memory plan's figure is the placed arrays' own, and bad meshes are errors naming the axis and flag."""

from __future__ import annotations

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_transformer.errors import ConfigError
from jax_transformer.model.sharding import MeshShape, check_divisible, spec_for, unsplit
from jax_transformer.settings.config import preset
from tests.helpers.training import report_on_cpu_devices, run_main


@pytest.mark.slow
def test_every_mesh_takes_the_single_device_step_and_holds_its_share():
    """(2,4,1), (2,2,2), (1,2,4) and (2,2,2) with 2 micro-batches, 3 steps, dropout on ((8,1,1) is
    test_training.py's sharded path): losses and
    parameters as single-device jit within `parallel_paths.check`'s tolerances of float summation order; each
    device holds 1/(fsdp x tensor) of the matrices and their Adam moments; the state keeps its layout across steps;
    the memory plan's arguments on (2,2,2) are the placed state's bytes (`mesh_paths.check_meshes`)."""
    from tests.helpers.mesh_paths import check_meshes

    report = report_on_cpu_devices("tests.helpers.mesh_paths", 8)
    assert report["devices"] == 8
    assert {name: p["mesh"] for name, p in report["paths"].items()} == {
        "jit": None,
        "data=2,fsdp=4": [2, 4, 1],
        "data=2,fsdp=2,tensor=2": [2, 2, 2],
        "fsdp=2,tensor=4": [1, 2, 4],
        "data=2,fsdp=2,tensor=2, accumulate 2": [2, 2, 2],
    }
    print("meshes vs jit, 3 steps, dropout on:\n  " + "\n  ".join(check_meshes(report)))


def test_bad_meshes_name_the_axis_sizes_and_flag():
    assert MeshShape.parse(None, 8) == MeshShape(8, 1, 1)
    assert MeshShape.parse("fsdp=4", 8) == MeshShape(2, 4, 1)  # data takes the devices the others leave
    with pytest.raises(
        ConfigError, match=r"--mesh data=2,fsdp=2,tensor=1: data x fsdp x tensor = 4, but the run has 8"
    ):
        MeshShape.parse("data=2,fsdp=2", 8)
    with pytest.raises(ConfigError, match=r"fsdp x tensor = 3 does not divide the 8 devices"):
        MeshShape.parse("tensor=3", 8)
    with pytest.raises(
        ConfigError, match=r"'pipeline=2' is not AXIS=SIZE with AXIS one of \('data', 'fsdp', 'tensor'\)"
    ):
        MeshShape.parse("pipeline=2", 8)
    with pytest.raises(ConfigError, match=r"the model's 4 attention heads \(num_heads\) do not split over tensor=8"):
        check_divisible(preset("tiny"), MeshShape(1, 1, 8))
    from jax_transformer.training import plan
    from jax_transformer.training.trainer import OptimConfig

    with pytest.raises(ConfigError, match=r"6 rows of a batch do not split over data x fsdp = 1 devices x 4 micro"):
        plan.plan_step(preset("tiny"), OptimConfig(), MeshShape(), rows=6, width=8, accumulate=4)
    code, out, err = run_main(["plan", "--preset", "tiny", "--mesh", "tensor=2"])
    assert code != 0 and "--mesh 'tensor=2': fsdp x tensor = 2 does not divide the 1 devices" in err + out, out + err


def test_an_axis_that_does_not_divide_leaves_the_array_whole_along_it():
    """NLLB's 256,206-entry vocabulary over fsdp=4: the table stays whole along fsdp (its width still over tensor)
    and the plan lists it; over fsdp=2 it splits. A layer norm stays whole; Adam's moment of a query kernel splits
    as the kernel does, its input over fsdp and its heads over tensor."""
    table = "params/shared_embed/embedding"
    assert spec_for(table, (256206, 1024), MeshShape(1, 4, 2)) == P(None, "tensor")
    assert spec_for(table, (256206, 1024), MeshShape(1, 2, 2)) == P("fsdp", "tensor")
    assert unsplit({"params": {"shared_embed": {"embedding": np.zeros((256206, 8))}}}, MeshShape(1, 4, 1)) == [
        f"{table} (256206, 8): dimension 0 of 256206 whole along fsdp=4"
    ]
    assert spec_for("params/encoder/final_norm/scale", (1024,), MeshShape(1, 4, 2)) == P()
    query = "opt_state/1/0/mu/encoder/layer_0/self_attention/query/kernel"  # Adam's moment of a parameter
    assert spec_for(query, (1024, 1024), MeshShape(2, 2, 4)) == P("fsdp", "tensor")


def test_plan_prints_the_step_memory_and_the_fit():
    code, out, err = run_main(["plan", "--preset", "tiny", "--max-tokens", "256"])
    assert code == 0, out + err
    assert "mesh data=1,fsdp=1,tensor=1 (1 devices)" in out
    for line in ("arguments", "outputs", "temporaries", "peak", "H100 80GB          yes", "TPU v5e (16 GiB)   yes"):
        assert line in out, out


@pytest.mark.slow
def test_remat_policies_take_the_same_step():
    """Recomputing each layer in the backward pass (`remat` full: the policies differ in what they keep, not in the
    mechanism) takes the step of keeping everything, up
    to float summation order (each tensor within 1e-4 of how far it moved in 2 steps, key biases left out: the
    tolerance and the reasons of `parallel_paths.check`), with the same parameter names."""
    import jax
    import numpy as np

    from jax_transformer.training import trainer
    from tests.helpers.batches import make_batch
    from tests.helpers.configs import unit_config
    from tests.helpers.twins import flat

    jax.config.update("jax_default_matmul_precision", "highest")
    config = unit_config().replace(num_encoder_layers=1, num_decoder_layers=1)
    optim = trainer.OptimConfig(warmup_steps=5)
    batch = make_batch(config, 0, 4, 12, 12, layout="noise", padding_row=False)
    start = flat(trainer.create_train_state(config, optim, seed=0).params)
    results = {}
    for remat in ("none", "full"):
        state = trainer.create_train_state(config.replace(remat=remat), optim, seed=0)
        step = trainer.make_train_step(config.replace(remat=remat), optim)
        for _ in range(2):
            state, sums = step(state, batch)
        results[remat] = float(sums["loss"]), flat(state.params)
    loss, reference = results["none"]
    for remat, (other_loss, params) in results.items():
        assert params.keys() == reference.keys()
        assert abs(other_loss / loss - 1) <= 1e-6, remat
        for key in reference:
            if "'key']['bias'" in key:
                continue
            moved = np.linalg.norm(reference[key] - start[key])
            assert np.linalg.norm(params[key] - reference[key]) <= 1e-4 * moved, (remat, key)
