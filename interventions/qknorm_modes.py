"""The choices of QK-RMSNorm injection, as plain data: how the gains start (`INIT_MODES`) and what recovery training
updates (`TRAINABLE_MODES`). `interventions.qknorm` (which loads torch), the registry and the commands all read
them from here."""

INIT_MODES = ("identity-gain", "scale-preserving", "blend")
TRAINABLE_MODES = ("gains", "attention", "all")
