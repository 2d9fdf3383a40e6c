//! ResourceSlice publishing against the real kube-apiserver v1.36.2 (resource.k8s.io/v1).

use std::collections::BTreeMap;

use kube::api::{Api, ListParams, PostParams};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use plugreg_dra::slices::{Attribute, Pool, Slice, SliceDevice, Stats, api_version, publish};
use plugreg_testpeers::{ApiServer, KubeVersion};

fn dev(name: &str, model: &str) -> SliceDevice {
    SliceDevice {
        name: name.into(),
        attributes: BTreeMap::from([
            ("model".to_owned(), Attribute::String(model.into())),
            ("example.com/index".to_owned(), Attribute::Int(1)),
            (
                "driverVersion".to_owned(),
                Attribute::Version("1.2.3".into()),
            ),
        ]),
    }
}

async fn slices(client: &kube::Client) -> Vec<DynamicObject> {
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("resource.k8s.io", "v1", "ResourceSlice"),
        "resourceslices",
    );
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &ar);
    let mut items = api.list(&ListParams::default()).await.unwrap().items;
    items.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    items
}

#[tokio::test]
async fn slices_are_accepted_by_the_real_v1_36_api_server_owned_by_the_node_and_regenerated() {
    let server = ApiServer::start_version(KubeVersion::V1_36_2)
        .await
        .unwrap();
    let client = server.client().await.unwrap();
    assert_eq!(api_version(&client).await.unwrap(), "v1");
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    let node = nodes
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({"metadata": {"name": "node-1"}})).unwrap(),
        )
        .await
        .unwrap();
    let driver = "gpu.example.com";

    let err = publish(&client, driver, "", &[]).await.unwrap_err();
    assert_eq!(err.to_string(), "no NodeName was set to publish resources");

    let mut pool = Pool {
        name: "node-1".into(),
        generation: 0,
        slices: vec![Slice {
            devices: vec![dev("gpu-0", "a100"), dev("gpu-1", "a100")],
        }],
    };
    let st = publish(&client, driver, "node-1", std::slice::from_ref(&pool))
        .await
        .unwrap();
    assert_eq!(
        st,
        Stats {
            created: 1,
            deleted: 0
        }
    );
    let s = slices(&client).await;
    assert_eq!(s.len(), 1);
    let name = s[0].metadata.name.clone().unwrap();
    assert!(name.starts_with("00000-gpu.example.com-node-1-"), "{name}");
    let owner = &s[0].metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str()),
        ("Node", "node-1")
    );
    assert_eq!(Some(&owner.uid), node.metadata.uid.as_ref());
    assert_eq!(owner.controller, Some(true));
    let spec = &s[0].data["spec"];
    assert_eq!(spec["nodeName"], "node-1");
    assert_eq!(
        spec["pool"],
        serde_json::json!({"name": "node-1", "generation": 0, "resourceSliceCount": 1})
    );
    assert_eq!(spec["devices"][1]["name"], "gpu-1");
    assert_eq!(
        spec["devices"][0]["attributes"]["model"],
        serde_json::json!({"string": "a100"})
    );

    // Unchanged: nothing written.
    let st = publish(&client, driver, "node-1", std::slice::from_ref(&pool))
        .await
        .unwrap();
    assert_eq!(st, Stats::default());
    assert_eq!(
        slices(&client).await[0].metadata.name.as_deref(),
        Some(name.as_str())
    );

    // Changed: a new generation; the old slice is gone.
    pool.slices[0].devices.pop();
    pool.slices.push(Slice {
        devices: vec![dev("gpu-9", "h100")],
    });
    let st = publish(&client, driver, "node-1", std::slice::from_ref(&pool))
        .await
        .unwrap();
    assert_eq!(
        st,
        Stats {
            created: 2,
            deleted: 1
        }
    );
    let s = slices(&client).await;
    assert_eq!(s.len(), 2);
    for (i, sl) in s.iter().enumerate() {
        assert!(
            sl.metadata
                .name
                .as_ref()
                .unwrap()
                .starts_with(&format!("0000{i}-gpu.example.com-node-1-"))
        );
        assert_eq!(sl.data["spec"]["pool"]["generation"], 1);
        assert_eq!(sl.data["spec"]["pool"]["resourceSliceCount"], 2);
    }

    // Invalid input is refused before any write.
    let dup = Pool {
        name: "p".into(),
        generation: 0,
        slices: vec![Slice {
            devices: vec![dev("x", "m"), dev("x", "m")],
        }],
    };
    let err = publish(&client, driver, "node-1", &[dup])
        .await
        .unwrap_err();
    assert_eq!(err.to_string(), "invalid pool p: duplicate device name x");

    // The pool is no longer published: its slices go.
    let st = publish(&client, driver, "node-1", &[]).await.unwrap();
    assert_eq!(
        st,
        Stats {
            created: 0,
            deleted: 2
        }
    );
    assert!(slices(&client).await.is_empty());
}
