"""Deployment files: cluster.yaml (ray up, AWS) and deploy/kuberay/*.yaml (KubeRay ray.io/v1).

Fast and offline: no Ray cluster, no AWS, no Kubernetes. cluster.yaml goes through Ray's own
validator: `ray up` first fills defaults (`prepare_config`), then checks the JSON schema and the
cross-field rules (`validate_config`); a raw YAML fails with "Missing 'cluster_synced_files'".
Neither step calls AWS (the provider bootstrap that does is not run here).
"""
from __future__ import annotations

import copy
import re
import shlex
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from ray.autoscaler._private.util import prepare_config, validate_config

REPO = Path(__file__).resolve().parents[1]
CLUSTER_YAML = REPO / "cluster.yaml"
KUBERAY_DIR = REPO / "deploy" / "kuberay"
KUBERAY_FILES = {"RayCluster": KUBERAY_DIR / "raycluster.yaml", "RayJob": KUBERAY_DIR / "rayjob.yaml"}
GPU_INSTANCE_FAMILIES = ("g", "p")  # AWS GPU families: g4dn, g5, g6, p4d, p5, ...


# --------------------------------------------------------------------------- helpers

def ray_pin() -> SpecifierSet:
    """The specifier of the `ray[...]` requirement in pyproject.toml, e.g. ==2.60.*."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    reqs = [Requirement(d) for d in deps if Requirement(d).name == "ray"]
    assert len(reqs) == 1, f"expected exactly one ray requirement in pyproject.toml, got {deps}"
    spec = reqs[0].specifier
    assert str(spec).startswith("=="), f"ray must be pinned with ==, got {spec!r}"
    return spec


def image_ray_version(image: str) -> Version:
    """Ray version an image is built on: rayproject/ray:<ver>-..., or a tag naming ray<ver>."""
    assert "ray-ml" not in image, f"{image}: the rayproject/ray-ml images are discontinued"
    repo, _, tag = image.rpartition(":")
    assert repo and tag and "/" not in tag, f"{image}: the image must carry an explicit tag"
    if repo.endswith("rayproject/ray"):
        m = re.match(r"(\d+\.\d+\.\d+)(?:-|$)", tag)
    else:  # derived image: the tag must say which Ray it was built FROM
        m = re.search(r"ray-?(\d+\.\d+\.\d+)(?:-|$)", tag)
    assert m, f"{image}: cannot read a pinned Ray version from the tag"
    return Version(m.group(1))


def load_cluster_yaml() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def prepared(config: dict) -> dict:
    """What `ray up` validates: the config after Ray fills its AWS defaults."""
    return prepare_config(copy.deepcopy(config))


def kuberay_docs() -> dict[str, dict]:
    out = {}
    for kind, path in KUBERAY_FILES.items():
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert [d.get("kind") for d in docs] == [kind], f"{path.name}: expected one {kind}"
        out[kind] = docs[0]
    return out


def ray_cluster_spec(doc: dict) -> dict:
    return doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]


def ray_containers(doc: dict) -> list[tuple[str, dict]]:
    """(group, container) for the Ray container of the head and of every worker group."""
    spec = ray_cluster_spec(doc)
    out = [("head", spec["headGroupSpec"]["template"]["spec"]["containers"][0])]
    for group in spec["workerGroupSpecs"]:
        out.append((group["groupName"], group["template"]["spec"]["containers"][0]))
    return out


def secret_env_names(container: dict) -> set[str]:
    """Env var names the container gets from a Secret (secretKeyRef or envFrom secretRef)."""
    names = {e["name"] for e in container.get("env", [])
             if "secretKeyRef" in e.get("valueFrom", {})}
    if any("secretRef" in src for src in container.get("envFrom", [])):
        names.add("*")  # every key of the Secret
    return names


def env_value(container: dict, name: str) -> str | None:
    for e in container.get("env", []):
        if e["name"] == name:
            return e.get("value")
    return None


# --------------------------------------------------------------------------- cluster.yaml

def test_cluster_yaml_passes_ray_validator():
    config = prepared(load_cluster_yaml())
    validate_config(config)  # raises on any schema or cross-field error
    assert config["provider"]["type"] == "aws"
    assert config["head_node_type"] in config["available_node_types"]


@pytest.mark.parametrize("path, bad_value", [
    (("available_node_types", "gpu_g5", "min_workers"), "two"),   # wrong type
    (("max_workers",), "ten"),
    (("available_node_types", "cpu_etl", "min_worker"), 1),        # misspelt key
])
def test_cluster_yaml_validator_rejects_broken_copy(path, bad_value):
    config = load_cluster_yaml()
    node = config
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = bad_value
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepared(config))


def test_cluster_yaml_images_match_pyproject_ray_pin():
    pin = ray_pin()
    config = load_cluster_yaml()
    images = [v for k, v in config["docker"].items() if k in ("image", "head_image", "worker_image")]
    for node_type in config["available_node_types"].values():
        images += [v for k, v in node_type.get("docker", {}).items() if k == "worker_image"]
    assert len(images) >= 2
    for image in images:
        assert image_ray_version(image) in pin, f"{image} does not satisfy ray{pin}"


def _effective_image(config: dict, type_name: str) -> str:
    docker = config["docker"]
    if type_name == config["head_node_type"]:
        return docker.get("head_image", docker["image"])
    override = config["available_node_types"][type_name].get("docker", {})
    return override.get("worker_image", docker.get("worker_image", docker.get("image")))


def _is_gpu_type(node_type: dict) -> bool:
    return node_type["node_config"]["InstanceType"].startswith(GPU_INSTANCE_FAMILIES)


def test_cluster_yaml_gpu_nodes_get_gpu_image_and_cpu_nodes_cpu_image():
    config = load_cluster_yaml()
    types = config["available_node_types"]
    assert any(_is_gpu_type(t) for t in types.values()), "no GPU worker group"
    assert any(not _is_gpu_type(t) for n, t in types.items() if n != config["head_node_type"]), \
        "no CPU worker group for ETL"
    for name, node_type in types.items():
        tag = _effective_image(config, name).rpartition(":")[2]
        if _is_gpu_type(node_type):
            assert re.search(r"-(gpu|cu\d+)", tag), f"{name}: GPU node needs a CUDA image, got {tag}"
        else:
            assert tag.endswith("-cpu"), f"{name}: CPU node should use the CPU image, got {tag}"
    assert types[config["head_node_type"]]["resources"].get("CPU") == 0, \
        "the head should advertise 0 CPUs so no work is scheduled there"


def _repo_mount(config: dict) -> str:
    """The node path that file_mounts maps to this repository (relative paths: from the repo root)."""
    mounts = [remote for remote, local in config["file_mounts"].items()
              if (REPO / Path(local).expanduser()).resolve() == REPO]
    assert len(mounts) == 1, f"file_mounts must map exactly one node path to the repo: {config['file_mounts']}"
    return mounts[0]


def test_cluster_yaml_setup_commands_install_this_repo_on_every_node():
    config = prepared(load_cluster_yaml())
    mount = _repo_mount(config)
    assert (REPO / "pyproject.toml").is_file()
    installs_repo = re.compile(r"\bpip install\b.*(?:\s|^)(?:-e\s+)?" + re.escape(mount) + r"/?(?:\s|$)")

    per_type = {config["head_node_type"]: config["head_setup_commands"]}
    for name, node_type in config["available_node_types"].items():
        if name != config["head_node_type"]:
            # A node type's own worker_setup_commands replace the merged global ones.
            per_type[name] = node_type.get("worker_setup_commands", config["worker_setup_commands"])
    for name, commands in per_type.items():
        assert any(installs_repo.search(c) for c in commands), \
            f"{name}: no `pip install {mount}` in {commands}"
        if _is_gpu_type(config["available_node_types"][name]):
            assert not any("whl/cpu" in c for c in commands), \
                f"{name}: a GPU node must keep PyPI's CUDA torch, not the CPU wheel"


def test_cluster_yaml_token_auth_and_private_dashboard():
    config = load_cluster_yaml()
    run_options = " ".join(config["docker"].get("run_options", []))
    head_start = " ".join(config["head_start_ray_commands"])
    worker_start = " ".join(config["worker_start_ray_commands"])
    assert "ray start --head" in head_start
    assert "--dashboard-host=127.0.0.1" in head_start
    for where, text in (("head", head_start), ("worker", worker_start)):
        assert "RAY_AUTH_MODE=token" in text or "RAY_AUTH_MODE=token" in run_options, where
    assert "RAY_AUTH_MODE=disabled" not in head_start + worker_start + run_options
    # The token file is shipped to the nodes, and Ray is told where it is.
    token_mounts = [r for r, l in config["file_mounts"].items() if l.endswith(".ray/auth_token")]
    assert token_mounts, "file_mounts must ship the local ~/.ray/auth_token"
    assert "RAY_AUTH_TOKEN_PATH" in run_options + head_start


# --------------------------------------------------------------------------- KubeRay

def test_kuberay_manifests_parse_and_have_the_expected_shape():
    for kind, doc in kuberay_docs().items():
        assert doc["apiVersion"] == "ray.io/v1"
        spec = ray_cluster_spec(doc)
        assert "headGroupSpec" in spec and spec["workerGroupSpecs"]
        gpu_groups = [g["groupName"] for g in spec["workerGroupSpecs"]
                      if int(g["template"]["spec"]["containers"][0]["resources"]["limits"]
                             .get("nvidia.com/gpu", 0)) >= 1]
        assert gpu_groups, f"{kind}: no worker group with an nvidia.com/gpu limit"
        for group in spec["workerGroupSpecs"]:
            assert 0 <= group["minReplicas"] <= group["maxReplicas"]
        assert spec["headGroupSpec"].get("serviceType", "ClusterIP") == "ClusterIP"


def test_kuberay_ray_versions_match_pyproject_pin():
    pin = ray_pin()
    for kind, doc in kuberay_docs().items():
        spec = ray_cluster_spec(doc)
        assert isinstance(spec["rayVersion"], str)
        assert Version(spec["rayVersion"]) in pin, f"{kind}: rayVersion {spec['rayVersion']}"
        images = [c["image"] for _, c in ray_containers(doc)]
        if kind == "RayJob":
            images += [c["image"] for c in doc["spec"]["submitterPodTemplate"]["spec"]["containers"]]
        for image in images:
            assert image_ray_version(image) == Version(spec["rayVersion"]), image
            assert image_ray_version(image) in pin, image
    # The derived images' documented base (Dockerfile FROM / BASE lines) uses the same Ray.
    text = KUBERAY_FILES["RayCluster"].read_text()
    bases = re.findall(r"(rayproject/ray:[\w.\-]+)", text)
    assert bases, "raycluster.yaml should document the rayproject/ray base image"
    for image in bases:
        assert image_ray_version(image) in pin, image


def test_rayjob_entrypoint_runs_raymill_with_valid_overrides():
    from stages.common.config import load_config

    doc = kuberay_docs()["RayJob"]
    argv = shlex.split(doc["spec"]["entrypoint"])
    assert argv[:2] == ["raymill", "run"], argv
    overrides = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    cfg = load_config(None, overrides)  # every --set key exists and type-checks
    assert cfg.run.source.startswith("s3://") and cfg.run.dir.startswith("s3://")
    assert cfg.ray.address == "auto", "the driver must join the RayJob's cluster"
    assert cfg.train.use_gpu is True
    assert "--config" in argv


def test_kuberay_secrets_come_from_secret_refs():
    for kind, doc in kuberay_docs().items():
        containers = ray_containers(doc)
        if kind == "RayJob":
            containers += [("submitter", c)
                           for c in doc["spec"]["submitterPodTemplate"]["spec"]["containers"]]
        for group, c in containers:
            from_secret = secret_env_names(c)
            where = f"{kind}/{group}"
            for name in ("RAY_AUTH_TOKEN",) + (() if group == "submitter" else
                                               ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")):
                assert name in from_secret or "*" in from_secret, f"{where}: {name} not from a Secret"
            if group != "submitter":
                endpoint = [e for e in c.get("env", []) if e["name"] == "AWS_ENDPOINT_URL"]
                assert "*" in from_secret or (endpoint and "AWS_ENDPOINT_URL" in from_secret), \
                    f"{where}: AWS_ENDPOINT_URL should come from the Secret"
            assert env_value(c, "RAY_AUTH_MODE") == "token", f"{where}: token auth not enabled"
            for e in c.get("env", []):  # no literal credentials anywhere
                if e["name"].startswith("AWS_") or e["name"] == "RAY_AUTH_TOKEN":
                    assert "value" not in e, f"{where}: literal value for {e['name']}"
        spec = ray_cluster_spec(doc)
        assert spec.get("authOptions", {}).get("mode") == "token"
        autoscaler_env = spec.get("autoscalerOptions", {}).get("env", [])
        if spec.get("enableInTreeAutoscaling"):
            assert "RAY_AUTH_TOKEN" in {e["name"] for e in autoscaler_env
                                        if "secretKeyRef" in e.get("valueFrom", {})}


def test_no_secret_objects_with_literal_data_are_shipped():
    for path in KUBERAY_FILES.values():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "Secret":
                pytest.fail(f"{path.name} ships a Secret; create it with kubectl instead")


def test_cluster_yaml_opens_no_ray_port_to_the_outside():
    """README, Security: Ray's ports stay inside the cluster's security group."""
    provider = load_cluster_yaml()["provider"]
    rules = provider.get("security_group", {}).get("IpPermissions", [])
    ray_ports = {6379, 8265, 10001, 8000, 44217, 44227}
    for rule in rules:
        opened = set(range(rule.get("FromPort", 0), rule.get("ToPort", 0) + 1))
        assert not opened & ray_ports, f"security group opens {sorted(opened & ray_ports)}"
