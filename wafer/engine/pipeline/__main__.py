"""`python -m wafer.engine.pipeline`: a stage process (stage.main)."""

from wafer.engine.pipeline.stage import main

main()
