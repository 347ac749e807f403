"""The MLflow side: the client every call goes through (client.py), registered versions (versions.py), the store's
recorder (recorder.py), the lineage of datasets and logged models (lineage.py), model cards (cards.py), what a model
source names (resolve.py) and garbage collection (gc.py). Imports store/ and the bottom of tasks/; never
orchestration/.

Tested through other modules' tests: gc.py (tests/scenarios/test_gc.py), lineage.py (tests/scenarios/test_lineage.py),
recorder.py (tests/tasks/tracking/test_outages.py), resolve.py (tests/app/test_cli.py), versions.py
(tests/tasks/test_registry.py, tests/tasks/tracking/test_client.py)."""
