"""justrl_megatron/import_hooks.py: a function runs on a module right after its body, before an importer sees it."""

import sys

from justrl_megatron.import_hooks import after_import


def test_a_hook_runs_after_the_modules_body_and_before_its_importer_sees_it(tmp_path, monkeypatch):
    (tmp_path / "hooked_lib.py").write_text("FLAG = 'as written'\nseen_at_import = FLAG\n")
    (tmp_path / "hooked_user.py").write_text("from hooked_lib import FLAG\nseen = FLAG\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("hooked_lib", "hooked_user"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    calls = []

    def hook(module):
        calls.append(module.seen_at_import)
        module.FLAG = "hooked"

    after_import("hooked_lib", hook)
    import hooked_user

    assert calls == ["as written"] and hooked_user.seen == "hooked"
    import hooked_lib  # noqa: F401  (imported again: the hook ran once)

    assert calls == ["as written"]
    after_import("hooked_lib", lambda module: calls.append("at once"))  # already imported: runs now
    assert calls == ["as written", "at once"]
