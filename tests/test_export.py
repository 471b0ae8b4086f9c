"""``export``: a program that loads with torch alone and scores as ``predict`` does."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from serving_cases import cli_json, cli_refusal, read_rows, split_sample, train_table

import torchrec_cowclip
from torchrec_cowclip.data.parsing.fields import parse_numeric
from torchrec_cowclip.serve.export import export_run

REPO = Path(__file__).resolve().parents[1]

# Loads a program and scores rows in a process where this package, TorchRec and FBGEMM
# cannot be imported (a serving host with torch alone).
SERVE = textwrap.dedent("""
    import sys

    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torchrec", "fbgemm_gpu", "torchrec_cowclip"):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
            return None

    sys.meta_path.insert(0, Refuse())
    import numpy as np
    import torch

    program, dense, ids, out = sys.argv[1:]
    if program.endswith(".pt2"):
        model = torch.export.load(program).module()
    else:
        model = torch.jit.load(program)
    scores = model(torch.from_numpy(np.load(dense)), torch.from_numpy(np.load(ids)))
    one = model(torch.from_numpy(np.load(dense)[:1]), torch.from_numpy(np.load(ids)[:1]))
    assert one.shape == (1,), one.shape
    np.save(out, scores.numpy())
    assert not any(m.split(".")[0] in ("torchrec", "fbgemm_gpu", "torchrec_cowclip")
                   for m in sys.modules)
""")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("export")
    files = split_sample(root / "data")
    # Every dense transform, missing-value indicators and quantile buckets: the program
    # computes the plan.
    spec = "minmax,I1=log,I2=standardize,I3=signed-log,I4=none"
    train_table(
        root / "run", files["train"], files["test"], root / "cache", dense_transform=spec,
        missing_indicator=True, dense_buckets=4,
    )  # fmt: skip
    return {"root": root, "run": root / "run", **files}


def _serving_inputs(trained: dict, serving: dict, vocabulary: dict, where: Path) -> tuple:
    """The test file as a serving stack would feed it, from the shipped contract and
    vocabulary only: raw dense values (NaN for missing), ids looked up by value."""
    header, *body = read_rows(trained["test"])
    dense_spec, ids_spec = serving["inputs"]
    dense = np.stack(
        [
            parse_numeric(np.array([r[header.index(c)].encode() for r in body]))[0]
            for c in dense_spec["columns"]
        ],
        axis=1,
    ).astype(np.float32)
    ids = np.array(
        [
            [vocabulary[c].get(r[header.index(c)], 0) if r[header.index(c)] else 1
             for c in ids_spec["columns"]]
            for r in body
        ],
        dtype=np.int64,
    )  # fmt: skip
    np.save(where / "dense.npy", dense)
    np.save(where / "ids.npy", ids)
    return where / "dense.npy", where / "ids.npy"


def _serve(program: Path, dense: Path, ids: Path, out: Path) -> np.ndarray:
    run = subprocess.run(
        [sys.executable, "-c", SERVE, str(program), str(dense), str(ids), str(out)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    return np.load(out)


def test_the_program_loads_with_torch_alone_and_scores_as_predict(trained, tmp_path, capsys):
    program = tmp_path / "model.pt2"
    report = cli_json(capsys, "export", "--run", trained["run"], "--out", program)
    assert report["max_abs_difference"] <= 1e-6
    names = sorted(Path(f).name for f in report["files"])
    assert names == ["model.pt2", "model.serving.json", "model.vocab.json", "model.vocab.npz"]
    serving = json.loads((tmp_path / "model.serving.json").read_text())
    plan = serving["inputs"][0]["plan"]
    transforms = [c["transform"] for c in plan["columns"]]
    assert transforms[:5] == ["log", "standardize", "signed-log", "none", "minmax"]
    assert any(c["missing_indicator"] for c in plan["columns"])
    assert sum(len(c.get("buckets", [])) == 3 for c in plan["columns"]) >= 5
    assert serving["output"]["shape"] == ["batch"]
    vocabulary = json.loads((tmp_path / "model.vocab.json").read_text())
    dense, ids = _serving_inputs(trained, serving, vocabulary, tmp_path)
    served = _serve(program, dense, ids, tmp_path / "served.npy")
    predicted = torchrec_cowclip.load_model(trained["run"]).predict(trained["test"])
    np.testing.assert_allclose(served, predicted, rtol=0, atol=1e-6)


def test_torchscript_and_half_tables(trained, tmp_path):
    report = export_run(trained["run"], tmp_path / "model.pt", fmt="torchscript")
    assert report["max_abs_difference"] <= 1e-6
    half = export_run(trained["run"], tmp_path / "half.pt2", table_dtype="fp16")
    assert 0 < half["max_abs_difference"] < 1e-3
    serving = json.loads((tmp_path / "model.serving.json").read_text())
    vocabulary = json.loads((tmp_path / "model.vocab.json").read_text())
    dense, ids = _serving_inputs(trained, serving, vocabulary, tmp_path)
    scripted = _serve(tmp_path / "model.pt", dense, ids, tmp_path / "scripted.npy")
    program = torch.export.load(str(tmp_path / "half.pt2")).module()
    halved = program(torch.from_numpy(np.load(dense)), torch.from_numpy(np.load(ids))).numpy()
    np.testing.assert_allclose(halved, scripted, atol=1e-3)


def test_export_refusals(trained, tmp_path, capsys):
    run = trained["run"]
    err = cli_refusal(capsys, "export", "--run", run, "--out", tmp_path / "model.onnx")
    assert "a export program is written as .pt2" in err
    taken = tmp_path / "model.pt2"
    taken.write_text("mine")
    err = cli_refusal(capsys, "export", "--run", run, "--out", taken)
    assert "exists: add --overwrite" in err and taken.read_text() == "mine"
    err = cli_refusal(capsys, "export", "--run", tmp_path, "--out", tmp_path / "x.pt2")
    assert "not a run folder" in err and not (tmp_path / "x.pt2").exists()


# --- torch.export of a model holding the collection ------------------------------------

# Loads the programs in a fresh process with TorchRec (the KJT's pytree) but not this
# package: the program must hold its tables and need no live collection.
LOAD_PROGRAMS = textwrap.dedent("""
    import sys

    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "torchrec_cowclip":
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
            return None

    sys.meta_path.insert(0, Refuse())
    import torch
    from torchrec import KeyedJaggedTensor

    for stem in sys.argv[1:]:
        inputs = torch.load(stem + ".inputs.pt", weights_only=True)
        kjt = KeyedJaggedTensor(keys=inputs["keys"], values=inputs["values"],
                                lengths=inputs["lengths"], weights=inputs.get("weights"))
        kjt.offsets()  # the fields the exported example carried
        model = torch.export.load(stem + ".pt2").module()
        args = (inputs["dense"], kjt) if "dense" in inputs else (kjt,)
        torch.save(model(*args).detach(), stem + ".out.pt")
""")


class _OwnModel(torch.nn.Module):
    """A user's own model: a linear layer over the collection's pooled output."""

    def __init__(self, ebc: torch.nn.Module, width: int) -> None:
        super().__init__()
        self.ebc, self.head = ebc, torch.nn.Linear(width, 1)

    def forward(self, kjt):
        return self.head(self.ebc(kjt).values()).squeeze(1)


def _saved_program(model, args, stem: Path, inputs) -> torch.Tensor:
    program = torch.export.export(model, args)
    # No pickled example inputs in the file (torch.export.load would unpickle a KJT).
    program.example_inputs = None
    torch.export.save(program, str(stem) + ".pt2")
    torch.save(inputs, str(stem) + ".inputs.pt")
    assert not [n for n in program.graph.nodes if "torchrec_cowclip" in str(n.target)]
    return program


def test_a_model_holding_the_collection_exports_whole_and_scores_as_eager_in_a_fresh_process(
    tmp_path,
):
    from cowclip_testing import kjt_from_bags
    from tiny import bag_config
    from torchrec.modules.embedding_configs import DataType, PoolingType

    from torchrec_cowclip import CowClipEmbeddingBagCollection, CowClipOptions
    from torchrec_cowclip.models import build_model

    tables = [
        bag_config("t0", 4, 10, ["f0"]),
        bag_config("t1", 4, 20, ["f1", "f2"], pooling=PoolingType.MEAN),
        bag_config("t2", 2, 20, ["f3"], data_type=DataType.FP16),
    ]
    ebc = CowClipEmbeddingBagCollection(tables, CowClipOptions(lr=0.1), is_weighted=True)
    own = _OwnModel(ebc, 14)
    bags = {"f0": [[1, 2], [3]], "f1": [[4], [5, 6]], "f2": [[], [7]], "f3": [[8], [9]]}
    weights = {"f0": [[0.5, 2.0], [1.0]], "f1": [[1.5], [1.0, 0.5]], "f2": [[], [2.0]]}
    weights["f3"] = [[1.0], [3.0]]
    kjt = kjt_from_bags(bags, weights)
    for _ in range(2):  # trained: the program holds the tables as they are now
        own(kjt).square().sum().backward()
    own_program = _saved_program(
        own,
        (kjt,),
        tmp_path / "own",
        {
            "keys": kjt.keys(),
            "values": kjt.values(),
            "lengths": kjt.lengths(),
            "weights": kjt.weights(),
        },
    )
    # The tables are the program's own state, under the collection's names.
    for table in ("t0", "t1", "t2"):
        key = f"ebc.embedding_bags.{table}.weight"
        assert torch.equal(
            own_program.state_dict[key], ebc.state_dict()[f"embedding_bags.{table}.weight"]
        )

    deepfm = build_model(
        "deepfm",
        sparse_names=["C1", "C2"],
        cardinalities=[30, 40],
        num_dense=3,
        hidden=(8,),
        embedding_dim=4,
        init_seed=1,
    )
    sparse = kjt_from_bags({"C1": [[3], [29], [7]], "C2": [[0], [39], [5]]})
    dense = torch.randn(3, 3)
    deepfm(dense, sparse).sum().backward()
    deepfm.eval()
    _saved_program(
        deepfm,
        (dense, sparse),
        tmp_path / "deepfm",
        {
            "keys": sparse.keys(),
            "values": sparse.values(),
            "lengths": sparse.lengths(),
            "dense": dense,
        },
    )

    stems = [str(tmp_path / "own"), str(tmp_path / "deepfm")]
    done = subprocess.run(
        [sys.executable, "-c", LOAD_PROGRAMS, *stems], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with torch.no_grad():
        for stem, eager in zip(stems, (own(kjt), deepfm(dense, sparse))):
            loaded = torch.load(stem + ".out.pt", weights_only=True)
            torch.testing.assert_close(loaded, eager, rtol=1e-6, atol=1e-6)
    # Exporting changed nothing: the collection still trains through its own op.
    before = ebc.state_dict()["embedding_bags.t0.weight"].clone()
    own(kjt).sum().backward()
    assert not torch.equal(before, ebc.state_dict()["embedding_bags.t0.weight"])
