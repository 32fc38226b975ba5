"""How the Docker backend reads the engine's container listing (``GET /containers/json``)."""

from __future__ import annotations

from streamrl.sandbox.docker import _container_name

# One entry exactly as Docker 26 listed it in a CI run: a sandbox container whose removal
# was stuck "in progress" for minutes, listed with no name. Every sweep failed on it with
# an IndexError (``Names[0]``) after removing, and before counting, the container the test
# waited for (test_docker_fleet: the sweeper's reaped count never came).
REMOVING = {
    "Id": "7885e4c713fec3b2592d18ecabc43d8957ac23e721c8caa7ddcdc23e7dcd2d96",
    "Names": [],
    "State": "removing",
    "Status": "Removal In Progress",
    "Labels": {"streamrl.instance": "400aaf26886c", "streamrl.owner": "vm~4026532209/7/3407471",
               "streamrl.sandbox": "1"},
    "Created": 1796679217,
}


def test_a_container_listed_without_a_name_is_named_by_its_short_id() -> None:
    assert _container_name(REMOVING) == "7885e4c713fe"


def test_a_named_container_is_named_without_the_slash() -> None:
    assert _container_name({**REMOVING, "Names": ["/streamrl-sb-1"]}) == "streamrl-sb-1"
