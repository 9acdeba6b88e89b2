# Shortcuts; the README's two commands are scripts/run and scripts/test.
UPSTREAM ?= http://127.0.0.1:11434

.PHONY: run test demo bench clean

run:
	scripts/run --upstream $(UPSTREAM)

test:
	scripts/test $(PYTEST_ARGS)

# demo and bench need the venv scripts/run or scripts/test made.
demo:
	.venv/bin/yieldproxy demo

bench:
	.venv/bin/python bench/run_all.py

clean:
	rm -rf .venv build dist *.egg-info
