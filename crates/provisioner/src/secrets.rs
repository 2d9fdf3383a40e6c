//! placeholder
#![allow(missing_docs, unused)]
#[derive(Debug, Clone)]
pub struct SecretRef {
    pub name: String,
    pub namespace: String,
}
#[derive(Debug, Clone, Default)]
pub struct PvSecrets {}
