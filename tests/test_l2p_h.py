"""csrc/l2p.h's L2P_GETTER refuses, at compile time, a getter whose signature the cast to
``getter`` would otherwise hide (one that does not take the file's L2P_GETTER_SELF *):
compiled here with the C compiler that builds the extension, a right getter and a wrong
one."""

import os
import shlex
import shutil
import subprocess
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER = os.path.join(ROOT, "csrc", "l2p.h")

SOURCE = """
#include <Python.h>
#include "{header}"
typedef struct {{ PyObject_HEAD int x; }} obj;
static PyObject *get_x({self_type} *self, void *c) {{ return PyLong_FromLong(1); }}
#define L2P_GETTER_SELF obj
PyGetSetDef rows[] = {{ L2P_GETTER(x, "x"), {{NULL}} }};
"""


def compile_getter(tmp_path, self_type):
    """(exit status, compiler output) of compiling SOURCE with get_x taking self_type *."""
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    include = sysconfig.get_paths()["include"]
    if shutil.which(cc[0]) is None or not os.path.exists(os.path.join(include, "Python.h")):
        pytest.skip("no C compiler or Python headers here to build the extension with")
    path = tmp_path / "getter.c"
    path.write_text(SOURCE.format(header=HEADER, self_type=self_type))
    run = subprocess.run(cc + ["-std=c11", "-Wall", "-Werror", "-Wno-unused-parameter",
                               "-I", include, "-c", str(path), "-o", os.devnull],
                         capture_output=True, text=True)
    return run.returncode, run.stderr


def test_a_getter_of_the_types_signature_compiles(tmp_path):
    rc, err = compile_getter(tmp_path, "obj")
    assert rc == 0, err


def test_a_getter_of_another_signature_does_not(tmp_path):
    rc, err = compile_getter(tmp_path, "PyObject")
    assert rc != 0
    assert "generic" in err.lower()   # gcc: "_Generic selector", clang: "generic association"
