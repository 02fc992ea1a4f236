"""Atomic writes: results get the permissions any new file gets, without the process umask ever changing."""

import os
import threading

from timm_rollout.atomic import new_file_mode, write_json


def test_written_files_get_the_umask_permissions_and_the_umask_never_changes(tmp_path):
    old = os.umask(0o027)
    try:
        seen = []
        stop = threading.Event()

        def watch() -> None:  # another thread of the process, reading the umask while files are written
            while not stop.is_set():
                current = os.umask(0o027)  # reading the umask means setting it; 0o027 is the value it must hold
                seen.append(current)

        thread = threading.Thread(target=watch)
        thread.start()
        for i in range(50):
            write_json(tmp_path / f"r{i}.json", {"i": i})
        stop.set()
        thread.join()
        assert set(seen) == {0o027}
        assert {(tmp_path / f"r{i}.json").stat().st_mode & 0o777 for i in range(50)} == {0o640}
        assert new_file_mode(tmp_path) == 0o640 and sorted(p.name for p in tmp_path.iterdir())[0] == "r0.json"
    finally:
        os.umask(old)
