"""scripts/horovod_includes.py on small source trees written here: which files it lists, and why."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("horovod_includes", ROOT / "scripts" / "horovod_includes.py")
assert spec is not None and spec.loader is not None
horovod_includes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(horovod_includes)

TREE = {
    # uses std::string, includes only <vector>: listed
    "horovod/common/a.h": "#include <vector>\nstd::string name();\n",
    # includes <string> itself: fine; c.h gets it through b.h: fine
    "horovod/common/b.h": '#include <string>\n#include "a.h"\nstd::string other();\n',
    "horovod/common/c.h": '#include "b.h"\nstd::string third();\n',
    # the include is commented out; a URL in a string does not hide the code after it: listed (both)
    "horovod/common/d.cc": ('// #include <string>\n#include <vector>\n'
                            'auto u = "http://x"; std::logic_error e("x"); std::string s;\n'
                            '/* std::runtime_error only in a comment */\n'),
    # a .cc #included into another is checked as part of it: e.cc is listed for impl.cc's std::string
    "horovod/common/ops/e.cc": '#include <vector>\nnamespace n {\n#include "impl.cc"\n}\n',
    "horovod/common/ops/impl.cc": "std::string from_fragment();\n",
    # int64_t through <cstdint> of a third_party header on the include path: fine
    "horovod/common/f.h": "#include <flatbuffers/base.h>\nint64_t n;\n",
    "third_party/flatbuffers/include/flatbuffers/base.h": "#include <cstdint>\n",
    # not built by hvdtrain: skipped
    "horovod/mxnet/x.h": "std::string skipped();\n",
}


def write(root: Path) -> Path:
    for name, text in TREE.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_lists_the_files_that_use_a_name_without_its_header(tmp_path: Path) -> None:
    # the tree sits under a folder named mxnet: only the tree's own folders decide what is skipped
    found = horovod_includes.missing_includes(write(tmp_path / "mxnet" / "src"))
    assert found == {"horovod/common/a.h": ["string"], "horovod/common/d.cc": ["string", "stdexcept"],
                     "horovod/common/ops/e.cc": ["string"]}


def test_main_exits_1_naming_them_and_0_when_none_and_2_without_a_tree(tmp_path: Path, capsys) -> None:
    src = write(tmp_path / "src")
    assert horovod_includes.main([str(src)]) == 1
    assert "horovod/common/a.h: uses names from <string> without including it" in capsys.readouterr().out
    for name in ("horovod/common/a.h", "horovod/common/d.cc", "horovod/common/ops/e.cc"):
        text = (src / name).read_text()
        (src / name).write_text("#include <stdexcept>\n#include <string>\n" + text)
    assert horovod_includes.main([str(src)]) == 0 and capsys.readouterr().out == ""
    assert horovod_includes.main([str(tmp_path / "nothing")]) == 2
    assert "unpacked horovod sdist" in capsys.readouterr().err
