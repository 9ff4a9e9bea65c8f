"""The training app behind ``python -m lightning_nnscaler.train`` and ``lightning-nnscaler train|plan``:
typed configs (``config``), the job (``job``), the sweep's comparison table (``summary``) and the
``plan`` command (``plan_command``), and the user's own modules imported in every process that trains
(``imports``)."""
