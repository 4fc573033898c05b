"""The console scripts' faces (`infinity-train`, `infinity-convert`, `infinity-make-model`,
`infinity-nvme-bench`): argument parsing and output around the library. Each module runs with
`python -m infinity.cli.<name>` from a checkout too."""
