"""The ground floor: config, storage, manifests, locks, fingerprints, Ray session, tracking, console.

Every stage imports these; they import no stage (`stages.<stage>`) and nothing from the roof
(`workflow/`). ARCHITECTURE.md explains the floors.
"""
