"""Preprocessing scripts: one per dataset, grouped by domain; each writes the standard parquet schema.

Run a script as a module from the repository root, e.g.
`python -m data_preprocess.math.deepscaler --input deepscaler.json --out data`; see docs/data.md.
"""
