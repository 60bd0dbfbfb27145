"""ondemand/files.py: ``write_atomic`` on real files in a temporary directory: the target replaced
whole, its mode (less the umask, or exact when asked), never written through a link, and on a
failure no temporary file left and the error naming the file asked for."""
import errno
import os
import stat

import pytest

from ondemand.files import write_atomic


def test_a_file_is_replaced_whole_with_its_mode_less_the_umask(tmp_path):
    target = tmp_path / "key"
    target.write_bytes(b"old, and longer than the new")
    old = os.umask(0o077)
    try:
        write_atomic(target, b"new", mode=0o644)
    finally:
        os.umask(old)
    assert target.read_bytes() == b"new" and stat.S_IMODE(target.stat().st_mode) == 0o600
    assert os.listdir(tmp_path) == ["key"]  # no temporary left beside it
    write_atomic(str(target), b"x" * (3 * 2**20))  # a str path, and more than one write's worth
    assert target.stat().st_size == 3 * 2**20 and stat.S_IMODE(target.stat().st_mode) == 0o600


def test_an_exact_mode_is_kept_whatever_the_umask(tmp_path):
    target = tmp_path / "page.html"
    old = os.umask(0o077)
    try:
        write_atomic(target, b"<p>", mode=0o644, exact_mode=True)
    finally:
        os.umask(old)
    assert stat.S_IMODE(target.stat().st_mode) == 0o644


def test_a_link_at_the_name_is_replaced_not_written_through(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"untouched")
    target = tmp_path / "key"
    target.symlink_to(elsewhere)
    write_atomic(target, b"new")
    assert not target.is_symlink() and target.read_bytes() == b"new"
    assert elsewhere.read_bytes() == b"untouched"


def test_a_failure_leaves_no_temporary_and_names_the_file_asked_for(tmp_path):
    missing = tmp_path / "no-such-dir" / "key"
    with pytest.raises(FileNotFoundError) as caught:
        write_atomic(missing, b"x")
    assert caught.value.filename == str(missing) and caught.value.filename2 is None
    taken = tmp_path / "a-directory"
    (taken / "inside").mkdir(parents=True)  # the rename over a directory that is not empty fails
    with pytest.raises(OSError) as caught:
        write_atomic(taken, b"x")
    assert caught.value.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST)
    assert caught.value.filename == str(taken) and caught.value.filename2 is None
    assert sorted(os.listdir(tmp_path)) == ["a-directory"] and os.listdir(taken) == ["inside"]


def test_a_link_planted_at_the_temporary_name_is_never_followed(tmp_path, monkeypatch):
    """The temporary's name is random; made known here (its random part fixed), a link planted at
    it is refused (O_EXCL), and the file it points to is never written."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"untouched")
    monkeypatch.setattr("ondemand.files.secrets.token_hex", lambda n: "f" * (2 * n))
    (tmp_path / f".key.{os.getpid()}.ffffffff.tmp").symlink_to(elsewhere)
    with pytest.raises(FileExistsError) as caught:
        write_atomic(tmp_path / "key", b"new")
    assert caught.value.filename == str(tmp_path / "key")
    assert elsewhere.read_bytes() == b"untouched" and not (tmp_path / "key").exists()
