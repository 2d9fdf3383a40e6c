//! Compact watch-cache entries: an object kept as its identity, typed, and the rest, trimmed
//! to what a sidecar's decisions read, as one JSON string.
//!
//! A controller sidecar caches every object of a kind it watches: one PersistentVolume per
//! volume, one claim, one VolumeAttachment per attached volume. Typed, k8s-openapi keeps every
//! volume source inline: a `PersistentVolume` is about 3.4 KiB before a single string, nearly
//! all of it `None`, and the objects the API server returns carry their managed fields on top.
//! [`Compact`] keeps the identity (its store key `namespace/name`, its UID and resource
//! version: what the store, the watch and a freshness check need) and the rest, trimmed by the
//! sidecar's [`Trim`], as JSON without the `None`s, `apiVersion` and `kind`, all four packed
//! in one allocation ([`Packed`]): a few hundred bytes. It lives in the kit's
//! [`CompactStore`](crate::cache::CompactStore)
//! ([`watch_compact`](crate::cache::watch_compact)), which keys it by itself: no `ObjectMeta`
//! of 360 bytes, mostly `None`, and no reflector key of four more strings beside it (about
//! 500 bytes an object less than kube-runtime's reflector store keeps). A sync decodes it
//! again ([`Compact::object`]), microseconds against the API writes and the driver call it then
//! makes. Each object of a list page or watch event is decoded whole, trimmed and encoded before
//! the next one is read, so a page never holds more than one full object at a time.
//!
//! Writes must never come from these copies: what a trim dropped would be lost. Sidecars change
//! objects with patches that name only what they change.
//!
//! The trim is a type of the sidecar's own ([`Trim`] on a marker type with the object as its
//! [`Trim::Object`]), so that two sidecars can keep different parts of the same kind.
//!
//! A sidecar that decodes less than the full object (a slim wire type of its own, reading only
//! the fields it uses) reads `null` as k8s-openapi does with [`null_as_default`] and names the
//! core/v1 kind with [`core_v1_resource!`](crate::core_v1_resource).

use std::borrow::Cow;
use std::marker::PhantomData;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::cache::{Keyed, store_key};

/// What a sidecar keeps of one kind of object.
pub trait Trim {
    /// The object kind.
    type Object: Resource<DynamicType = ()> + Serialize + DeserializeOwned + Default;

    /// Drops of `obj` what no decision reads. The identity (name, namespace, UID, resource
    /// version) is kept by [`Compact`] whatever this does; managed fields are always dropped.
    fn trim(obj: &mut Self::Object);
}

/// An object's identity and trimmed rest as a cache keeps them: its store key, UID,
/// resourceVersion and rest back to back in one allocation. A cache holds one per object,
/// thousands of them, and four boxed strings would be four heap blocks (each with malloc's
/// header and rounding) and 64 bytes of pointers; packed they are one block and 32 bytes.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Packed {
    /// The key, the UID, the resourceVersion and the rest, in that order.
    text: Box<str>,
    /// Where the key, the UID and the resourceVersion end in `text`.
    ends: [u32; 3],
    /// Which of the UID (bit 0) and the resourceVersion (bit 1) are set (`None` is not `""`).
    set: u8,
}

impl Packed {
    /// `key`, `uid`, `resource_version` and `rest`, packed. Objects are far smaller than the
    /// 4 GiB the offsets reach (the API server takes at most 3 MiB).
    pub fn new(key: &str, uid: Option<&str>, resource_version: Option<&str>, rest: &str) -> Self {
        let parts = [key, uid.unwrap_or(""), resource_version.unwrap_or(""), rest];
        let mut text = String::with_capacity(parts.iter().map(|p| p.len()).sum());
        let mut ends = [0; 3];
        for (i, part) in parts.iter().enumerate() {
            text.push_str(part);
            if let Some(end) = ends.get_mut(i) {
                *end = u32::try_from(text.len()).unwrap_or(u32::MAX);
            }
        }
        Self {
            text: text.into_boxed_str(),
            ends,
            set: u8::from(uid.is_some()) | (u8::from(resource_version.is_some()) << 1),
        }
    }

    fn part(&self, i: usize) -> &str {
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        let end = self.ends.get(i).map_or(self.text.len(), |&e| e as usize);
        self.text.get(start..end).unwrap_or_default()
    }

    /// The store key ([`store_key`]).
    pub fn key(&self) -> &str {
        self.part(0)
    }

    /// The name: the key after its `/` (a namespace's name has none), or all of it.
    pub fn name(&self) -> &str {
        let key = self.key();
        key.split_once('/').map_or(key, |(_, name)| name)
    }

    /// The namespace: the key before its `/` (`None` for a cluster-scoped object).
    pub fn namespace(&self) -> Option<&str> {
        self.key().split_once('/').map(|(ns, _)| ns)
    }

    /// The UID.
    pub fn uid(&self) -> Option<&str> {
        (self.set & 1 != 0).then(|| self.part(1))
    }

    /// The resourceVersion.
    pub fn resource_version(&self) -> Option<&str> {
        (self.set & 2 != 0).then(|| self.part(2))
    }

    /// The rest.
    pub fn rest(&self) -> &str {
        self.part(3)
    }
}

impl std::fmt::Debug for Packed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Packed")
            .field("key", &self.key())
            .field("uid", &self.uid())
            .field("resource_version", &self.resource_version())
            .field("rest", &self.rest())
            .finish()
    }
}

/// An object as cached (see the module docs).
pub struct Compact<T: Trim> {
    /// Its [`store_key`] (`namespace/name`, or the name of a cluster-scoped object), UID,
    /// resourceVersion and the trimmed rest (JSON without `apiVersion` and `kind`).
    packed: Packed,
    trim: PhantomData<fn() -> T>,
}

impl<T: Trim> std::fmt::Debug for Compact<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Compact").field(&self.packed).finish()
    }
}

impl<T: Trim> Clone for Compact<T> {
    fn clone(&self) -> Self {
        Self {
            packed: self.packed.clone(),
            trim: PhantomData,
        }
    }
}

impl<T: Trim> Compact<T> {
    /// The cached form of `obj`.
    pub fn new(mut obj: T::Object) -> Self {
        T::trim(&mut obj);
        let m = obj.meta_mut();
        m.managed_fields = None;
        let key = store_key(m);
        m.name = None;
        m.namespace = None;
        let uid = m.uid.take();
        let resource_version = m.resource_version.take();
        // Serialising k8s-openapi types and plain serde structs cannot fail (string keys only).
        let mut rest = serde_json::to_value(&obj).unwrap_or_default();
        if let Value::Object(o) = &mut rest {
            o.remove("apiVersion");
            o.remove("kind");
            if o.get("metadata")
                .is_some_and(|m| m.as_object().is_some_and(|m| m.is_empty()))
            {
                o.remove("metadata");
            }
        }
        Self {
            packed: Packed::new(
                &key,
                uid.as_deref(),
                resource_version.as_deref(),
                &rest.to_string(),
            ),
            trim: PhantomData,
        }
    }

    /// The object's name.
    pub fn name(&self) -> &str {
        self.packed.name()
    }

    /// The object's namespace (`None` for a cluster-scoped object).
    pub fn namespace(&self) -> Option<&str> {
        self.packed.namespace()
    }

    /// The object's UID.
    pub fn uid(&self) -> Option<&str> {
        self.packed.uid()
    }

    /// The object's resourceVersion.
    pub fn resource_version(&self) -> Option<&str> {
        self.packed.resource_version()
    }

    /// The object as the decisions read it (trimmed, see [`Trim`]).
    pub fn object(&self) -> T::Object {
        // Written by `new` from the same type: it decodes.
        let mut obj: T::Object = serde_json::from_str(self.packed.rest()).unwrap_or_default();
        let m = obj.meta_mut();
        m.name = Some(self.name().to_owned()).filter(|n| !n.is_empty());
        m.namespace = self.namespace().map(str::to_owned);
        m.uid = self.uid().map(str::to_owned);
        m.resource_version = self.resource_version().map(str::to_owned);
        obj
    }

    /// The bytes the rest of the object takes (for tests and sizing).
    pub fn rest_len(&self) -> usize {
        self.packed.rest().len()
    }
}

impl<'de, T: Trim> Deserialize<'de> for Compact<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        T::Object::deserialize(d).map(Compact::new)
    }
}

/// What a list page or a watch event decodes into before the store keeps its [`Compact`]:
/// the compact form beside the identity as an `ObjectMeta` (what kube-runtime's watcher reads
/// of an object, its resourceVersion above all). Decoding into it trims each object of a page
/// as it is read, so that a page of 500 objects never holds 500 full typed objects at once;
/// [`Decoded::into_compact`] is the `compact` function of
/// [`watch_compact`](crate::cache::watch_compact).
pub struct Decoded<T: Trim> {
    metadata: ObjectMeta,
    compact: Compact<T>,
}

impl<T: Trim> Decoded<T> {
    /// The decoded form of `obj`.
    pub fn new(obj: T::Object) -> Self {
        let m = obj.meta();
        let metadata = ObjectMeta {
            name: m.name.clone(),
            namespace: m.namespace.clone(),
            uid: m.uid.clone(),
            resource_version: m.resource_version.clone(),
            ..ObjectMeta::default()
        };
        Self {
            metadata,
            compact: Compact::new(obj),
        }
    }

    /// The compact form the store keeps.
    pub fn into_compact(self) -> Compact<T> {
        self.compact
    }
}

impl<T: Trim> std::fmt::Debug for Decoded<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.compact.fmt(f)
    }
}

impl<T: Trim> Clone for Decoded<T> {
    fn clone(&self) -> Self {
        Self {
            metadata: self.metadata.clone(),
            compact: self.compact.clone(),
        }
    }
}

impl<'de, T: Trim> Deserialize<'de> for Decoded<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        T::Object::deserialize(d).map(Decoded::new)
    }
}

impl<T: Trim> Resource for Decoded<T> {
    type DynamicType = ();
    type Scope = <T::Object as Resource>::Scope;

    fn kind(_: &()) -> Cow<'_, str> {
        T::Object::kind(&())
    }
    fn group(_: &()) -> Cow<'_, str> {
        T::Object::group(&())
    }
    fn version(_: &()) -> Cow<'_, str> {
        T::Object::version(&())
    }
    fn api_version(_: &()) -> Cow<'_, str> {
        T::Object::api_version(&())
    }
    fn plural(_: &()) -> Cow<'_, str> {
        T::Object::plural(&())
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl<T: Trim> Keyed for Compact<T> {
    fn key(&self) -> &str {
        self.packed.key()
    }
}

/// Keeps of `m` the identity, the annotations named in `keep` and, with `lifecycle`, the
/// finalizers and the deletion time; drops the rest (labels, owner references, timestamps, ...).
pub fn trim_meta(m: &mut ObjectMeta, keep: &[&str], lifecycle: bool) {
    let annotations = m.annotations.take().map(|mut a| {
        a.retain(|key, _| keep.contains(&key.as_str()));
        a
    });
    *m = ObjectMeta {
        name: m.name.take(),
        namespace: m.namespace.take(),
        uid: m.uid.take(),
        resource_version: m.resource_version.take(),
        finalizers: m.finalizers.take().filter(|_| lifecycle),
        deletion_timestamp: m.deletion_timestamp.take().filter(|_| lifecycle),
        annotations: annotations.filter(|a| !a.is_empty()),
        ..ObjectMeta::default()
    };
}

/// `null` reads as the default, as k8s-openapi reads every field of the full object: a slim
/// wire type (one that reads only the fields a sidecar uses) whose fields carry
/// `#[serde(default, deserialize_with = "null_as_default")]` reads whatever the full object
/// reads, an explicit `null` included.
pub fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// What [`core_v1_resource!`](crate::core_v1_resource) names, reachable from the crates that
/// use it.
#[doc(hidden)]
pub mod __macro_support {
    pub use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    pub use kube::Resource;
    pub use std::borrow::Cow;
}

/// Implements `kube::Resource` for a slim wire type of a core/v1 kind (group `""`, version
/// `v1`): `core_v1_resource!(Type, Scope, "Kind", "plural")`, where `Type` has a field
/// `metadata: ObjectMeta` and `Scope` is k8s-openapi's `ClusterResourceScope` or
/// `NamespaceResourceScope`. A watch of the type then lists and watches that kind's objects,
/// decoding only the fields the type reads.
///
/// ```
/// use k8s_openapi::ClusterResourceScope;
/// use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
///
/// #[derive(Default)]
/// struct SlimNode {
///     metadata: ObjectMeta,
/// }
/// plugreg_sidecar_kit::core_v1_resource!(SlimNode, ClusterResourceScope, "Node", "nodes");
///
/// assert_eq!(<SlimNode as kube::Resource>::url_path(&(), None), "/api/v1/nodes");
/// ```
#[macro_export]
macro_rules! core_v1_resource {
    ($ty:ty, $scope:ty, $kind:literal, $plural:literal) => {
        impl $crate::compact::__macro_support::Resource for $ty {
            type DynamicType = ();
            type Scope = $scope;

            fn kind(_: &()) -> $crate::compact::__macro_support::Cow<'_, str> {
                $kind.into()
            }
            fn group(_: &()) -> $crate::compact::__macro_support::Cow<'_, str> {
                "".into()
            }
            fn version(_: &()) -> $crate::compact::__macro_support::Cow<'_, str> {
                "v1".into()
            }
            fn api_version(_: &()) -> $crate::compact::__macro_support::Cow<'_, str> {
                "v1".into()
            }
            fn plural(_: &()) -> $crate::compact::__macro_support::Cow<'_, str> {
                $plural.into()
            }
            fn meta(&self) -> &$crate::compact::__macro_support::ObjectMeta {
                &self.metadata
            }
            fn meta_mut(&mut self) -> &mut $crate::compact::__macro_support::ObjectMeta {
                &mut self.metadata
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use serde_json::json;

    #[test]
    fn packed_parts_come_back_as_given_with_none_apart_from_empty() {
        let p = Packed::new("ns/a", Some("u-1"), Some("42"), r#"{"data":{"k":"v"}}"#);
        assert_eq!(
            (p.key(), p.namespace(), p.name()),
            ("ns/a", Some("ns"), "a")
        );
        assert_eq!(p.uid(), Some("u-1"));
        assert_eq!(p.resource_version(), Some("42"));
        assert_eq!(p.rest(), r#"{"data":{"k":"v"}}"#);
        let q = Packed::new("b", None, Some(""), "{}");
        assert_eq!(
            (q.key(), q.uid(), q.resource_version(), q.rest()),
            ("b", None, Some(""), "{}")
        );
        assert_eq!((q.namespace(), q.name()), (None, "b"));
        let empty = Packed::default();
        assert_eq!(
            (
                empty.key(),
                empty.uid(),
                empty.resource_version(),
                empty.rest()
            ),
            ("", None, None, "")
        );
        // One pointer to one block, three offsets and the flags: half of four boxed strings.
        assert_eq!(std::mem::size_of::<Packed>(), 32);
        assert_eq!(std::mem::size_of::<Compact<Cm>>(), 32);
    }

    /// A trim that keeps the data and one annotation.
    enum Cm {}
    impl Trim for Cm {
        type Object = ConfigMap;
        fn trim(obj: &mut ConfigMap) {
            trim_meta(&mut obj.metadata, &["keep"], true);
            obj.binary_data = None;
        }
    }

    fn wire() -> Value {
        json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "c", "namespace": "ns", "uid": "u", "resourceVersion": "7",
                "labels": {"a": "b"}, "finalizers": ["f"],
                "annotations": {"keep": "1", "drop": "2"},
                "managedFields": [{"manager": "m", "operation": "Update"}]},
            "data": {"k": "v"},
            "binaryData": {"b": "AAAA"},
        })
    }

    #[test]
    fn keeps_the_identity_and_what_the_trim_keeps() {
        let c: Compact<Cm> = serde_json::from_value(wire()).unwrap();
        assert_eq!(
            (c.name(), c.namespace(), c.uid(), c.resource_version()),
            ("c", Some("ns"), Some("u"), Some("7"))
        );
        assert_eq!(c.key(), "ns/c");
        let o = c.object();
        assert_eq!(o.data, Some([("k".to_owned(), "v".to_owned())].into()));
        assert_eq!(o.binary_data, None);
        assert_eq!(o.metadata.finalizers, Some(vec!["f".to_owned()]));
        assert_eq!(
            o.metadata.annotations,
            Some([("keep".to_owned(), "1".to_owned())].into())
        );
        assert_eq!((o.metadata.labels, o.metadata.managed_fields), (None, None));
        assert_eq!(o.metadata.uid.as_deref(), Some("u"));
        assert!(
            !c.packed.rest().contains("ConfigMap"),
            "{}",
            c.packed.rest()
        );
    }

    /// A list page's item decodes straight into its compact form, with the identity the
    /// watcher reads beside it.
    #[test]
    fn a_decoded_object_is_its_compact_form_with_its_identity() {
        let d: Decoded<Cm> = serde_json::from_value(wire()).unwrap();
        assert_eq!(
            (
                d.meta().name.as_deref(),
                d.meta().namespace.as_deref(),
                d.meta().uid.as_deref(),
                d.meta().resource_version.as_deref()
            ),
            (Some("c"), Some("ns"), Some("u"), Some("7"))
        );
        assert_eq!(
            (d.meta().labels.as_ref(), d.meta().finalizers.as_ref()),
            (None, None)
        );
        assert_eq!(Decoded::<Cm>::plural(&()), "configmaps");
        let c = d.into_compact();
        let direct: Compact<Cm> = serde_json::from_value(wire()).unwrap();
        assert_eq!(c.packed, direct.packed);
    }

    /// `null` metadata and missing fields read as the full type reads them.
    #[test]
    fn reads_nulls_as_the_full_type_does() {
        let w = json!({"metadata": null, "data": null});
        let c: Compact<Cm> = serde_json::from_value(w.clone()).unwrap();
        let full: ConfigMap = serde_json::from_value(w).unwrap();
        assert_eq!(c.object(), full);
        assert_eq!((c.name(), c.namespace()), ("", None));
    }

    #[derive(Debug, Default, Deserialize)]
    struct SlimPod {
        #[serde(default)]
        metadata: ObjectMeta,
        #[serde(default, deserialize_with = "null_as_default")]
        labels: std::collections::BTreeMap<String, String>,
    }
    crate::core_v1_resource!(SlimPod, k8s_openapi::NamespaceResourceScope, "Pod", "pods");

    /// An explicit `null` reads as the default, as a missing field does.
    #[test]
    fn null_reads_as_the_default() {
        let p: SlimPod = serde_json::from_value(json!({"labels": null})).unwrap();
        assert!(p.labels.is_empty());
        let p: SlimPod = serde_json::from_value(json!({"labels": {"a": "b"}})).unwrap();
        assert_eq!(p.labels.get("a").map(String::as_str), Some("b"));
    }

    /// The macro's impl names the core/v1 kind as k8s-openapi's own type does.
    #[test]
    fn a_core_v1_resource_is_named_as_the_full_type() {
        use k8s_openapi::api::core::v1::Pod;
        assert_eq!(SlimPod::kind(&()), Pod::kind(&()));
        assert_eq!(SlimPod::group(&()), Pod::group(&()));
        assert_eq!(SlimPod::version(&()), Pod::version(&()));
        assert_eq!(SlimPod::api_version(&()), Pod::api_version(&()));
        assert_eq!(SlimPod::plural(&()), Pod::plural(&()));
        assert_eq!(
            SlimPod::url_path(&(), Some("ns")),
            Pod::url_path(&(), Some("ns"))
        );
        let mut p = SlimPod::default();
        p.meta_mut().name = Some("p".into());
        assert_eq!(p.meta().name.as_deref(), Some("p"));
    }
}
