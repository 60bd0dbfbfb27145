"""ondemand/engines/dockerapi.py, every call of the package to the Docker API, without a real
Docker: the container's candidate ids read from /proc's texts and files, and against the Docker
Engine API double on a Unix socket (tests/docker_double.py, aiodocker's real client talking to
it): the networks ondemand's container is attached to (found by /proc's id or a believed hint,
a network gone between two calls, the decider network's subnets), "outside Docker", an image
inspected and never pulled, and docker info. The backend's container life cycle on a real
Docker: tests/heavy/test_docker_backend.py (the ``docker`` marker); the peer policy built on
these: tests/gateway/test_peers.py."""
import pytest
from docker_double import DockerDouble, networked

from ondemand.engines import dockerapi
from ondemand.engines.dockerapi import AttachedNetwork, OutsideDocker, container_ids_from_proc, own_networks


def test_container_ids_from_proc():
    cid = "a" * 64
    other = "b" * 64
    mountinfo = (f"612 590 0:54 /docker/containers/{cid}/hostname /etc/hostname rw,relatime - ext4 "
                 "/dev/nvme0n1p2 rw\n605 590 0:54 / / rw - overlay overlay rw\n")
    cgroup_v1 = f"12:pids:/docker/{other}\n11:cpuset:/docker/{other}\n"
    cgroup_v2 = f"0::/system.slice/docker-{other}.scope\n"
    assert container_ids_from_proc("0::/\n", mountinfo) == [cid]
    assert container_ids_from_proc(cgroup_v1, mountinfo) == [cid, other]
    assert container_ids_from_proc(cgroup_v2, "") == [other]
    assert container_ids_from_proc("0::/user.slice/" + "c" * 64, "") == []
    assert container_ids_from_proc(None, None) == []



def test_read_proc_ids_reads_both_files_and_does_without_either(tmp_path):
    cid, other = "a" * 64, "b" * 64
    assert dockerapi.read_proc_ids(None) == [] and dockerapi.read_proc_ids(str(tmp_path)) == []
    (tmp_path / "cgroup").write_text(f"0::/system.slice/docker-{other}.scope\n")
    assert dockerapi.read_proc_ids(str(tmp_path)) == [other]
    (tmp_path / "mountinfo").write_text(f"1 2 0:1 /docker/containers/{cid}/hostname /etc/hostname rw\n")
    assert dockerapi.read_proc_ids(str(tmp_path)) == [cid, other]


async def test_own_networks_by_a_hint_with_the_deciders_subnets_when_not_attached_to_it():
    d, cid = networked()
    async with d as sock:
        attached, decider = await own_networks(f"unix://{sock}", None, cid[:12], "decider")
        assert decider == ["172.30.0.0/24"]
        [net] = attached
        assert (net.name, net.subnets) == ("dgxmm", ("172.18.0.0/16", "fd00:18::/64"))
        assert set(net.gateways) == {"172.18.0.1", "fd00:18::1"} and net.id
        d.connect(cid, "decider", "172.30.0.3")  # attached to it: no subnets of its own to refuse
        attached, decider = await own_networks(f"unix://{sock}", None, cid[:12], "decider")
        assert decider is None and {n.name for n in attached} == {"dgxmm", "decider"}
        assert (await own_networks(f"unix://{sock}", None, cid, "nowhere"))[1] is None  # not found


async def test_own_networks_by_procs_id_and_a_network_gone_between_two_calls(tmp_path):
    d, cid = networked()
    (tmp_path / "mountinfo").write_text(f"1 2 0:1 /docker/containers/{cid}/hostname /etc/hostname rw\n")
    d.remove_network("dgxmm")  # the container's endpoint is all that is left of it
    async with d as sock:
        attached, _ = await own_networks(f"unix://{sock}", str(tmp_path), "not-a-container", None)
    assert [(n.name, n.subnets) for n in attached] == [("dgxmm", ("172.18.0.0/16", "fd00:18::/64"))]
    assert AttachedNetwork("x") == AttachedNetwork("x", (), (), "")


async def test_outside_docker_without_an_id_or_with_a_hint_it_does_not_believe():
    d, cid = networked()
    d.add_container("dgx01", {"dgxmm": "172.18.0.9"}, hostname="f00d")  # its hostname is not the hint
    async with d as sock:
        with pytest.raises(OutsideDocker, match="no container id"):
            await own_networks(f"unix://{sock}", None, None, None)
        for hint in ("laptop", "dgx01"):
            with pytest.raises(OutsideDocker, match=hint):
                await own_networks(f"unix://{sock}", None, hint, None)
        d.fail_status = 500  # Docker failing is no answer: it is raised as it is
        with pytest.raises(dockerapi.DockerError):
            await own_networks(f"unix://{sock}", None, cid, None)


async def test_an_image_is_inspected_never_pulled_and_info_is_dockers():
    d = DockerDouble()
    d.add_image("sim:1", ["python3"])
    async with d as sock:
        async with dockerapi.client(f"unix://{sock}") as docker:
            assert await dockerapi.image_present(docker, "sim:1") is True
            assert await dockerapi.image_present(docker, "sim") is False  # sim:latest
            assert await dockerapi.image_present(docker, "vllm/vllm-openai:latest") is False
            d.info["Runtimes"]["nvidia"] = {"path": "nvidia-container-runtime"}
            assert "nvidia" in (await dockerapi.info(docker))["Runtimes"]
    assert not [p for p in d.requests if "pull" in p or "create" in p]
