"""The Dockerfiles, read as text (images cannot be built on the test machine): dependencies
in a layer before the sources, sshd installed, the GPU image in setup.sh's GPU mode."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def instructions(name):
    with open(os.path.join(ROOT, "docker", name)) as f:
        text = re.sub(r"\\\n", " ", f.read())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_dependencies_are_a_layer_before_the_sources(name):
    lines = instructions(name)
    deps = next(i for i, l in enumerate(lines) if "HVD_ADAPT_DEPS_ONLY=1 scripts/setup.sh" in l)
    copy_all = lines.index("COPY . .")
    assert deps < copy_all < next(i for i, l in enumerate(lines)
                                  if l.startswith("RUN scripts/setup.sh"))
    for line in lines[:deps]:
        if line.startswith("COPY "):
            for path in line.split()[1:-1]:
                assert os.path.exists(os.path.join(ROOT, path)), path
    assert any("openssh-server" in l for l in lines) and any("/run/sshd" in l for l in lines)
    assert any("HVD_ADAPT_VENV=/opt/venv" in l for l in lines)


def test_gpu_image_builds_horovod_with_nccl_from_a_cuda_devel_base():
    lines = instructions("Dockerfile.gpu")
    assert re.match(r"FROM nvidia/cuda:[0-9.]+-devel-", lines[0])
    assert any("HVD_ADAPT_GPU=1" in l for l in lines)


# -- docker/k8s: the MPIJob, checked against the operator's API and Kubernetes' schema -------
K8S = os.path.join(ROOT, "docker", "k8s")


def k8s_documents(name):
    import yaml
    with open(os.path.join(K8S, name)) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def mpijob_errors(job):
    import json

    import jsonschema
    with open(os.path.join(K8S, "mpijob-v2beta1.schema.json")) as f:
        schema = json.load(f)
    jsonschema.Draft202012Validator.check_schema(schema)
    return [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(job)]


def pod_template_errors(template):
    import kubernetes_validate
    try:
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                      "metadata": {"name": "t"}, "template": template},
                                     "1.30", strict=True)
    except kubernetes_validate.ValidationError as e:
        return [str(e).splitlines()[0]]
    return []


def test_the_mpijob_is_valid_for_the_operator_and_its_pods_for_kubernetes():
    (job,) = k8s_documents("mpijob.yaml")
    assert mpijob_errors(job) == []
    for role in ("Launcher", "Worker"):
        assert pod_template_errors(job["spec"]["mpiReplicaSpecs"][role]["template"]) == []
    import kubernetes_validate
    for doc in k8s_documents("shared-volume.yaml"):
        kubernetes_validate.validate(doc, "1.30", strict=True)


def test_the_validators_refuse_a_broken_mpijob():
    import copy
    (job,) = k8s_documents("mpijob.yaml")
    bad = copy.deepcopy(job)
    bad["spec"]["runPolicy"]["cleanPodPolicy"] = "Sometimes"
    bad["spec"]["slotPerWorker"] = 1
    errors = mpijob_errors(bad)
    assert any("Sometimes" in e for e in errors) and any("slotPerWorker" in e for e in errors)
    worker = copy.deepcopy(job["spec"]["mpiReplicaSpecs"]["Worker"]["template"])
    worker["spec"]["containers"][0]["readinessProbe"]["tcpSocket"]["prot"] = 22
    assert pod_template_errors(worker)


def test_the_mpijob_runs_the_example_through_discovery_standbys_and_a_drain():
    import shlex
    (job,) = k8s_documents("mpijob.yaml")
    launcher = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]
    worker = job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]
    args = launcher["containers"][0]["args"]
    assert launcher["containers"][0]["command"] == ["horovodrun"]
    for flag in ("--min-np", "--max-np", "--slots", "--blacklist-cooldown-range"):
        assert flag in args, flag
    discovery = shlex.split(args[args.index("--host-discovery-script") + 1])
    assert discovery[:3] == ["hvd-adapt-discover", "--command", "/etc/mpi/discover_hosts.sh"]
    assert discovery[discovery.index("--max-np") + 1] == args[args.index("--max-np") + 1]
    # The launch stub hands a slot to a standby only when their commands are the same.
    stub = args[args.index("hvd-adapt-worker"):]
    launched = stub[stub.index("--") + 1:]
    assert launched[:2] == ["python", "examples/digits/train.py"]
    script = shlex.split(worker["containers"][0]["args"][0].replace("\\\n", " "))
    standby = script[script.index("--standby"):]
    assert standby[standby.index("--") + 1:standby.index("sleep")] == launched
    assert standby[standby.index("--standby-dir") + 1] == stub[stub.index("--standby-dir") + 1] \
        == discovery[discovery.index("--standby-dir") + 1]
    # Workers answer ssh before they count, hold a GPU, and outlive the drain.
    assert worker["containers"][0]["readinessProbe"]["tcpSocket"]["port"] == 22
    assert "/usr/sbin/sshd" in script
    assert worker["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    for pod in (launcher, worker):
        assert pod["terminationGracePeriodSeconds"] > 5 + 10
        assert pod["containers"][0]["image"] == "hvd_adapt:gpu"
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert mounts["shared"] == "/shared"
    assert {"name": "HVD_ADAPT_HINTS", "value": "/shared/hints.json"} in \
        launcher["containers"][0]["env"]


# -- docker/k8s: the pool, its arbiter, and a job of the pool ----------------------------
def test_the_pool_and_its_arbiter_are_valid_for_kubernetes_and_a_job_of_it_for_the_operator():
    import kubernetes_validate
    docs = k8s_documents("pool.yaml")
    assert [d["kind"] for d in docs] == ["ConfigMap", "Service", "StatefulSet", "Deployment"]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30", strict=True)
    (job,) = k8s_documents("pool-mpijob.yaml")
    assert mpijob_errors(job) == []
    assert list(job["spec"]["mpiReplicaSpecs"]) == ["Launcher"]     # the pool's hosts only
    assert pod_template_errors(job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]) == []


def test_the_arbiter_and_the_jobs_discovery_meet_in_one_folder_with_the_same_code():
    """The commands parse with hvd_adapt's own parsers; the arbiter's folder is the
    discovery's --arbiter on the volume both mount; the pool's host file lists the
    StatefulSet's pods; one arbiter at a time; the launcher reaches the pool with the
    pool's key."""
    import shlex

    from hvd_adapt.scheduling import arbiter, discover
    config, service, pool, deployment = k8s_documents("pool.yaml")
    (job,) = k8s_documents("pool-mpijob.yaml")
    launcher = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    arbiter_args = arbiter.parser().parse_args(container["args"])
    args = launcher["containers"][0]["args"]
    discovery = shlex.split(args[args.index("--host-discovery-script") + 1])
    assert discovery[0] == "hvd-adapt-discover"
    discovery_args = discover.parser().parse_args(discovery[1:])
    assert discovery_args.arbiter == arbiter_args.folder
    assert discovery_args.max_np == int(args[args.index("--max-np") + 1])
    assert discovery_args.hints == {e["name"]: e["value"] for e in
                                    launcher["containers"][0]["env"]}["HVD_ADAPT_HINTS"]

    def mounted(pod, path):
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
        top = next(p for p in mounts if path.startswith(p.rstrip("/") + "/"))
        return {v["name"]: v for v in pod["volumes"]}[mounts[top]]
    claim = mounted(deployment["spec"]["template"]["spec"], arbiter_args.folder)
    assert claim == mounted(launcher, discovery_args.arbiter)
    assert claim["persistentVolumeClaim"]["claimName"] == "hvd-adapt-shared"
    hostfile = mounted(deployment["spec"]["template"]["spec"], arbiter_args.hostfile)
    assert hostfile["configMap"]["name"] == config["metadata"]["name"]
    from hvd_adapt.scheduling.base import parse_hosts
    hosts, problems = parse_hosts(config["data"]["hosts"], 1, "hosts")
    assert not problems and [h for h, _ in hosts] == [
        f"{pool['metadata']['name']}-{i}.{service['metadata']['name']}"
        for i in range(pool["spec"]["replicas"])]
    assert pool["spec"]["serviceName"] == service["metadata"]["name"]
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    key = mounted(launcher, "/root/.ssh/id_ed25519")["secret"]["secretName"]
    assert key == mounted(pool["spec"]["template"]["spec"],
                          "/root/.ssh/authorized_keys")["secret"]["secretName"]
    assert job["spec"]["sshAuthMountPath"] != "/root/.ssh"
