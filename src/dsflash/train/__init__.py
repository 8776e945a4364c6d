"""Training the demo model (`python -m dsflash.train`): data, tokenizer, a teacher-forced fit of the V4.1 code.

Nothing imports this package (tests/unit/test_layers.py): serving never trains, it loads the committed files.
"""
