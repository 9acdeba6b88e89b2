# Two entry points a newcomer needs (see README):
#   make run UPSTREAM=http://127.0.0.1:11434   install into .venv and start the proxy
#   make test                                  install into .venv and run every test
PYTHON ?= python3
VENV ?= .venv
UPSTREAM ?= http://127.0.0.1:11434
BIN := $(VENV)/bin

.PHONY: install test run demo bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# A regular (not editable) install: twistd only finds the plugin in site-packages.
install: $(BIN)/python
	$(BIN)/pip install --quiet .
	$(BIN)/python -c "from twisted.plugin import IPlugin, getPlugins; list(getPlugins(IPlugin))"

install-test: $(BIN)/python
	$(BIN)/pip install --quiet '.[test]'
	$(BIN)/python -c "from twisted.plugin import IPlugin, getPlugins; list(getPlugins(IPlugin))"

run: install
	$(BIN)/twistd -n yieldproxy --upstream $(UPSTREAM)

demo: install
	$(BIN)/yieldproxy demo

test: install-test
	$(BIN)/pytest $(PYTEST_ARGS)

bench: install-test
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info
