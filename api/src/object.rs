//! `Object<T>`: a request body that must be a JSON object of `T`'s shape. serde's derive
//! alone would also take a struct's array form (`["00"]` for `{"tx": "00"}`), which no
//! OpenAPI document of Kvasir allows; this reads `T` from the object's entries as they are
//! parsed, building nothing else (no `Value` tree a large body could inflate).

use std::fmt;
use std::marker::PhantomData;

use serde::de::value::MapAccessDeserializer;
use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

pub struct Object<T>(pub T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Entries<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for Entries<T> {
            type Value = T;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(MapAccessDeserializer::new(map))
            }
        }
        deserializer
            .deserialize_map(Entries(PhantomData))
            .map(Object)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, Deserialize)]
    struct Pair {
        a: u8,
        b: String,
    }

    #[test]
    fn only_the_object_form_is_read() {
        let Object(pair) = serde_json::from_str::<Object<Pair>>(r#"{"b": "x", "a": 1}"#).unwrap();
        assert_eq!(
            pair,
            Pair {
                a: 1,
                b: "x".into()
            }
        );
        // The derive alone takes the array form; `Object` does not.
        assert!(serde_json::from_str::<Pair>(r#"[1, "x"]"#).is_ok());
        let refused = serde_json::from_str::<Object<Pair>>(r#"[1, "x"]"#)
            .err()
            .unwrap();
        assert!(refused.to_string().contains("a JSON object"), "{refused}");
        assert!(serde_json::from_str::<Object<Pair>>(r#"{"a": 1}"#).is_err());
    }
}
