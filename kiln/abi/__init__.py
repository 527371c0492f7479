"""Reading compiled binaries without loading them: ELF section headers, CUDA fatbins
(listed and slimmed to chosen archs), the torch operator schemas compiled into
upstream's attention extensions and the Python calls that must bind to them (fa2), and
the manylinux tag a compiled wheel's glibc symbols allow (auditwheel).
"""
