//! Volume group snapshots (the `CSIVolumeGroupSnapshot` gate): the VolumeGroupSnapshotContent
//! controller beside the content controller. The snapshot-controller makes a group content for
//! each VolumeGroupSnapshot; this side cuts the group with CreateVolumeGroupSnapshot, writes the
//! group and its members into the status (from which the snapshot-controller makes the
//! members' VolumeSnapshotContents, which the content controller then treats as group members:
//! never CreateSnapshot or DeleteSnapshot), asks GetVolumeGroupSnapshot about a
//! pre-provisioned group, and deletes the group with DeleteVolumeGroupSnapshot.
//!
//! Decisions are [`decide`]'s; [`controller`] carries them out.

pub mod controller;
pub mod decide;
